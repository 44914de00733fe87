"""A family's whole-model HF interop, as its spec names it (``TowerSpec.interop``): which HF ``config.json`` it
imports, the import, the export, and the HF class an export writes once the import has read it back (the support
matrix's cell). ``neva.convert`` and ``neva.support`` ask these and never a family's name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neva.families import TOWERS, part
from neva.models.config import NevaConfig


@dataclass(frozen=True)
class Interop:
    """How one family's models go to and from transformers.

    Attributes:
        name: what the interop is (for messages).
        recognises: whether an HF ``config.json`` dict is one this interop imports.
        import_dir: ``(hf_dir, out, *, metadata, dtype, max_shard_bytes, overwrite) -> Path``.
        import_parts: ``(hf_dir) -> ImportedParts``: the import up to the writing (a model in memory).
        export: ``(ckpt, out, *, conv_template, dtype, max_shard_bytes, overwrite) -> Path``.
        round_trip: the HF ``model_type`` an export of a model of this config writes, after its import has read
            the config back (raises ``ConfigError`` where the export refuses).
    """

    name: str
    recognises: Callable[[dict[str, Any]], bool]
    import_dir: Callable[..., Path]
    import_parts: Callable[..., Any]
    export: Callable[..., Path]
    round_trip: Callable[[NevaConfig], str]


DEFAULT = "neva.checkpoint.llava_hf:LLAVA_HF"
"""The interop of a model without a tower (a text-only decoder goes out through the llava-hf path)."""


def interop_for(cfg: NevaConfig) -> Interop:
    """The interop of a neva model: its tower family's."""
    return part(DEFAULT if cfg.vision is None else cfg.vision.spec.interop)


def interop_for_hf(hf: dict[str, Any]) -> Interop:
    """The interop that imports an HF ``config.json`` dict: the first family's that recognises it, else the
    llava-hf path (which refuses a model type it has no wrapper for, naming it)."""
    for path in dict.fromkeys(spec.interop for spec in TOWERS.values()):
        interop = part(path)
        if interop.recognises(hf):
            return interop
    return part(DEFAULT)
