"""A family's whole-model HF interop, as its spec names it (``TowerSpec.interop``): which HF ``config.json`` it
imports, the import, the export, and the HF class an export writes once the import has read it back (the support
matrix's cell). ``neva.convert`` and ``neva.support`` ask these and never a family's name."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.neva_format import save_checkpoint
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from neva.families import DECODERS, TOWERS, decoder_spec, part
from neva.models.config import NevaConfig
from neva.typed import ConfigError


@dataclass(frozen=True)
class Interop:
    """How one family's models go to and from transformers.

    Attributes:
        name: what the interop is (for messages).
        recognises: whether an HF ``config.json`` dict is one this interop imports.
        import_parts: ``(hf_dir, *, dtype, metadata) -> ImportedParts``: the import up to the writing (a model in
            memory); ``import_dir`` writes it as a neva checkpoint.
        export: ``(ckpt, out, *, conv_template, dtype, max_shard_bytes, overwrite) -> Path``.
        round_trip: the HF ``model_type`` an export of a model of this config writes, after its import has read
            the config back (raises ``ConfigError`` where the export refuses).
        peft_names: ``(cfg) -> (saved_key, saved_modules)``: a LoRA run's parts saved whole in its PEFT adapter,
            named as this family's HF model names them (``peft_adapter.save_peft_adapter``); None: llava-hf's names.
        peft_adapter: False where a LoRA run of this family is not written as a PEFT adapter yet (``adapter_names``
            refuses it in one line; the merged export is written).
    """

    name: str
    recognises: Callable[[dict[str, Any]], bool]
    import_parts: Callable[..., Any]
    export: Callable[..., Path]
    round_trip: Callable[[NevaConfig], str]
    peft_names: Callable[[NevaConfig], Any] | None = None
    peft_adapter: bool = True

    def adapter_names(self, cfg: NevaConfig) -> Any:
        """``peft_names(cfg)`` (None: llava-hf's names).

        Raises:
            ConfigError: this family's LoRA runs are not written as PEFT adapters yet (``peft_adapter``).
        """
        if not self.peft_adapter:
            article = "an" if self.name[0] in "AEIOU" else "a"
            raise ConfigError(
                f"{article} {self.name} LoRA run is not written as a PEFT adapter yet: export the merged model "
                "(neva-to-hf without --peft-adapter)"
            )
        return None if self.peft_names is None else self.peft_names(cfg)

    def import_dir(
        self,
        hf_dir: str | os.PathLike,
        out: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        metadata: dict[str, Any] | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
    ) -> Path:
        """Convert an HF directory of this family to a neva checkpoint (streaming, every tensor's name and shape
        checked before one is written: ``import_parts``)."""
        cfg, tensors, tokenizer, meta = self.import_parts(hf_dir, dtype=dtype, metadata=metadata)
        return save_checkpoint(
            out, cfg, tensors, tokenizer, max_shard_bytes=max_shard_bytes, metadata=meta, overwrite=overwrite
        )


def round_trip_through(
    config_dict: Callable[[NevaConfig], dict[str, Any]], read_config: Callable[[dict[str, Any]], Any]
) -> Callable[[NevaConfig], str]:
    """An ``Interop.round_trip`` for a family whose export writes ``config_dict(arch)``: that config read back by the
    family's import (which refuses what it cannot build), and the model type it names."""

    def round_trip(arch: NevaConfig) -> str:
        config = config_dict(arch)
        read_config(config)
        return config["model_type"]

    return round_trip


def own_template(export: Callable[..., Path]) -> Callable[..., Path]:
    """An ``Interop.export`` for a family whose export ships its own chat template: the neva template a caller names
    (``conv_template``) is not written."""

    def write(ckpt: str | os.PathLike, out: str | os.PathLike, *, conv_template: str | None = None, **common: Any):
        return export(ckpt, out, **common)

    return write


DEFAULT = "neva.checkpoint.llava_hf:LLAVA_HF"
"""The interop of a model without a tower (a text-only decoder goes out through the llava-hf path)."""


def interop_for(cfg: NevaConfig) -> Interop:
    """The interop of a neva model: its decoder family's where that fixes the HF class (Gemma 3's), else its tower
    family's (a Qwen-VL class, or the llava-hf wrappers around any decoder)."""
    decoder = decoder_spec(cfg.llm.family).interop
    if decoder is not None:
        return part(decoder)
    return part(DEFAULT if cfg.vision is None else cfg.vision.spec.interop)


def interop_for_hf(hf: dict[str, Any]) -> Interop:
    """The interop that imports an HF ``config.json`` dict: the first family's that recognises it, else the
    llava-hf path (which refuses a model type it has no wrapper for, naming it)."""
    paths = [spec.interop for spec in DECODERS.values() if spec.interop] + [spec.interop for spec in TOWERS.values()]
    for path in dict.fromkeys(paths):
        interop = part(path)
        if interop.recognises(hf):
            return interop
    return part(DEFAULT)
