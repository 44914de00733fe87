"""An HF model directory as a neva model in memory: ``neva.convert hf-to-neva``'s import (llava-hf, Qwen2-VL /
Qwen2.5-VL / Qwen3-VL), every tensor name and shape checked the same way, without writing a checkpoint, so that
``neva.evaluate --checkpoint HF_DIR`` scores a downloaded model with the same harness as a trained one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.hf_import import ImportedParts
from neva.checkpoint.hf_read import load_hf_config
from neva.checkpoint.interop import interop_for_hf
from neva.checkpoint.llava_original import read_llava_config
from neva.checkpoint.neva_format import TIED_HEAD_KEY
from neva.errors import ConfigError
from neva.hf_local import model_dir
from neva.models.neva import NevaModel
from neva.models.rope import rope_inv_freq


def is_hf_model_dir(path: str | os.PathLike) -> bool:
    """A directory with a transformers ``config.json`` (a ``model_type``); a neva checkpoint's has none."""
    try:
        return "model_type" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def hf_parts(path: str | os.PathLike) -> ImportedParts:
    """The import's parts for the directory's family.

    Raises:
        ConfigError: LLaVA's original layout (it needs the tower directory: convert it first), no tokenizer.
    """
    directory = model_dir(path)
    if read_llava_config(directory) is not None:
        raise ConfigError(
            f"--checkpoint {path}: LLaVA's original layout (llava_llama config) needs its vision tower's directory; "
            "convert it first: python -m neva.convert hf-to-neva --hf DIR --vision TOWER_DIR --out CKPT"
        )
    parts = interop_for_hf(load_hf_config(directory)).import_parts(directory)
    if parts.tokenizer is None:
        raise ConfigError(f"--checkpoint {path}: no tokenizer in the HF directory (tokenizer.json / tokenizer.model)")
    return parts


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple[NevaModel, Any, dict]:
    """``(model in eval mode, tokenizer, metadata)`` of an HF directory, as a checkpoint converted from it loads.

    Raises:
        ConfigError, ValueError: as ``hf_parts`` and the import (unsupported family, tensors that map nowhere).
    """
    cfg, tensors, tokenizer, meta = hf_parts(path)
    with torch.device("meta"):
        model = NevaModel(cfg)
    model.to(dtype=dtype)
    model.to_empty(device="cpu")
    llm = model.llm
    if cfg.llm.tie_word_embeddings and llm.output is not None and llm.tok_embeddings is not None:
        llm.output.weight = llm.tok_embeddings.weight  # to_empty unties shared parameters
    targets = model.state_dict()
    for key, tensor in tensors:  # names and shapes were checked against cfg by the import
        if key == TIED_HEAD_KEY and cfg.llm.tie_word_embeddings:
            continue
        targets[key].copy_(tensor)
    llm.inv_freq = rope_inv_freq(cfg.llm, device=llm.inv_freq.device)
    return model.eval(), tokenizer, meta
