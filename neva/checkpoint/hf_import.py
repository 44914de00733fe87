"""A llava-hf directory (``llava``, ``llava_next``, ``llava_onevision``, ``llava_next_video``; current or legacy key
layout, safetensors or ``.bin``) → a neva checkpoint, streaming (``hf_read``).

Key names come from the flat tables in ``hf_keys``, the config from ``hf_config``; a chat template written by neva's
export (``hf_files``) gives back the template settings the model was trained with.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from neva.checkpoint.hf_config import neva_config_from_llava
from neva.checkpoint.hf_files import read_template_settings
from neva.checkpoint.hf_keys import detect_prefixes
from neva.checkpoint.hf_read import (
    cast_floating,
    check_complete,
    has_tokenizer,
    hf_tensor_shapes,
    iter_hf_tensors,
    load_hf_config,
    map_keys,
    with_image_stats,
)
from neva.checkpoint.neva_format import save_checkpoint
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from neva.constants import IMAGE_TOKEN
from neva.hf_local import model_dir
from neva.models.config import NevaConfig


class ImportedParts(NamedTuple):
    """What an HF import gives before anything is written: the model's config, its tensors under neva's names (a
    stream, every name and shape already checked), the tokenizer (None without one) and the checkpoint metadata."""

    cfg: NevaConfig
    tensors: Iterator[tuple[str, torch.Tensor]]
    tokenizer: Any
    metadata: dict[str, Any]


def import_llava(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Convert a llava-hf directory (current or legacy key layout, safetensors or ``.bin``) to a neva checkpoint.

    Args:
        hf_dir: directory with ``config.json`` (``LlavaConfig``), weights and, ideally, the tokenizer.
        out: neva checkpoint directory to create.
        dtype: cast floating tensors to this dtype; None keeps the stored dtypes.
        metadata: extra entries for the checkpoint's ``config.json``.
        max_shard_bytes: output shard size limit.
        overwrite: replace an existing ``out``.

    Returns:
        ``out``.

    Raises:
        ValueError: tensors that map nowhere or model tensors that are missing; an ``<image>`` token whose id differs
            from the config's ``image_token_index``.
    """
    cfg, tensors, tokenizer, meta = llava_parts(hf_dir, dtype=dtype, metadata=metadata)
    return save_checkpoint(
        out, cfg, tensors, tokenizer, max_shard_bytes=max_shard_bytes, metadata=meta, overwrite=overwrite
    )


def llava_parts(
    hf_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, metadata: dict[str, Any] | None = None
) -> ImportedParts:
    """``import_llava`` up to the writing (also what ``neva.evaluate`` loads an HF directory in memory with).

    Raises:
        ValueError: as ``import_llava``.
    """
    hf_dir = Path(model_dir(hf_dir))
    cfg = with_image_stats(neva_config_from_llava(load_hf_config(hf_dir)), hf_dir)
    shapes = hf_tensor_shapes(hf_dir)
    mapping = map_keys(list(shapes), detect_prefixes(list(shapes)), hf_dir)
    check_complete(cfg, {mapping[k]: shapes[k] for k in mapping}, str(hf_dir))
    tokenizer = None
    if has_tokenizer(hf_dir):
        from neva.data.sentencepiece_tokenizer import load_tokenizer as load_hf_tokenizer

        tokenizer = load_hf_tokenizer(hf_dir)
        _check_image_token(tokenizer, cfg.image_token_id, hf_dir)
    meta = {"source": {"kind": "llava-hf", "path": str(hf_dir)}, **_template_metadata(hf_dir, tokenizer, metadata)}
    tensors = ((mapping[k], cast_floating(t, dtype)) for k, t in iter_hf_tensors(hf_dir) if k in mapping)
    return ImportedParts(cfg, tensors, tokenizer, meta)


def _template_metadata(hf_dir: Path, tokenizer: Any, metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The caller's metadata plus the template settings of a neva export (its chat template's mark).

    A built-in template's Jinja is dropped from the tokenizer: neva renders built-ins itself (BOS from the tokenizer),
    and a tokenizer chat template would take precedence for ``mistral``/``llama_3``/``chatml``.
    """
    metadata = dict(metadata or {})
    settings = read_template_settings(hf_dir)
    if settings is None:
        if "conv_template" not in metadata:
            warnings.warn(
                f"{hf_dir} has no chat template written by neva and no --conv-template was given: neva.generate will "
                "render prompts as vicuna_v1 (LLaVA-1.5's format); pass --conv-template if the model was trained "
                "with another",
                stacklevel=3,
            )
        return metadata
    if settings.get("builtin") and tokenizer is not None:
        tokenizer.chat_template = None
    if "conv_template" in metadata and metadata["conv_template"] != settings["conv_template"]:
        return metadata  # the caller's choice wins, the export's system prompt belongs to its template
    for key in ("conv_template", "system_prompt", "use_chat_template"):
        metadata.setdefault(key, settings.get(key))
    return metadata


def _check_image_token(tokenizer: Any, image_token_id: int, source: Path) -> None:
    found = tokenizer.get_vocab().get(IMAGE_TOKEN)
    if found is None:
        warnings.warn(f"{source}: tokenizer has no {IMAGE_TOKEN} token; prompts cannot place images", stacklevel=3)
    elif found != image_token_id:
        raise ValueError(f"{source}: tokenizer maps {IMAGE_TOKEN} to {found}, config says image token {image_token_id}")
