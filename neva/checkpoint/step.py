"""A run's step checkpoints as whole models: what ``neva.convert``, ``neva.generate`` and ``neva.evaluate`` read.

A training checkpoint is a one-process Lightning file (``<exp_dir>/checkpoints/step=N.ckpt``, ``last.ckpt``) or a
distributed run's DCP directory of the same names. Each records the run's resolved config (``CONFIG_KEY``), so the
architecture, tokenizer and LoRA setup are found there, exactly as the run built them (``resolve_source``). The
checkpoint is verified against its manifest, its tensors are read as plain data (the file's, or DCP's pieces of every
rank), LoRA is merged as the end-of-stage export merges it, and the result is a neva checkpoint: the format every
reader of ``final`` takes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint import dcp, neva_format, verified
from neva.checkpoint.names import canonical_name, named_parameters
from neva.checkpoint.source import copy_full, resolve_source
from neva.config import TrainConfig
from neva.models.lora import merged_state_dict
from neva.models.trainable import build_meta_model
from neva.typed import build

log = logging.getLogger(__name__)

DCP_LOOP_STATE = "meta.pt"
"""The loop-state file of a DCP checkpoint directory (Lightning's ``_METADATA_FILENAME``): config, step, counters."""


def is_step_checkpoint(path: str | os.PathLike) -> bool:
    """A one-process checkpoint file, or a DCP checkpoint directory (not a neva checkpoint directory)."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and (path / DCP_LOOP_STATE).is_file())


def whole_weights(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A one-process checkpoint's tensors under plain names (popped from ``checkpoint``): the module's state dict,
    with the fp32 master copies of an O2 run in place of the trained low-precision parameters."""
    weights = {canonical_name(k.removeprefix("model.")): v for k, v in checkpoint.pop("state_dict").items()}
    weights.update(checkpoint.pop("master_weights", None) or {})
    return weights


def recorded_config(checkpoint: dict[str, Any], path: Path) -> TrainConfig:
    """The run's config as the checkpoint records it; the data section keeps only what inference uses (the data
    files need not exist any more), and LLaVA's projector file is not read again (the checkpoint holds the projector).

    Raises:
        verified.CheckpointError: the checkpoint records no config (written by an older neva).
    """
    record = checkpoint.get(verified.CONFIG_KEY)
    if record is None:
        raise verified.CheckpointError(
            f"{path} records no run config (written by an older neva); convert the run's `final` checkpoint instead"
        )
    data = json.loads(record)
    recorded = data["model"]["data"]
    data["model"]["data"] = {k: recorded[k] for k in ("conv_template", "image_aspect_ratio") if k in recorded}
    data["model"]["mm_cfg"]["pretrain_mm_mlp_adapter"] = None
    return build(TrainConfig, data)


def materialize(
    path: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype | None = None, overwrite: bool = False
) -> Path:
    """Write step checkpoint ``path`` as a neva checkpoint directory ``out`` (LoRA merged).

    Args:
        path: ``step=N.ckpt`` / ``last.ckpt``: a one-process file or a DCP directory.
        out: the neva checkpoint directory to create.
        dtype: cast floating tensors to this dtype; None keeps fp32 (as the end-of-stage export writes).
        overwrite: replace an existing ``out``.

    Raises:
        verified.CheckpointError: no or wrong manifest (an interrupted save, a corrupt file), no recorded config, or
            content other than tensors and plain data.
        KeyError: a model tensor the checkpoint lacks.
        ValueError: a tensor whose shape is not the model's.
    """
    path = Path(path)
    step = verified.verify(path)
    loop = verified.load_state(path if path.is_file() else path / DCP_LOOP_STATE)
    cfg = recorded_config(loop, path)
    source = resolve_source(cfg)
    model = build_meta_model(source.cfg, cfg.model.trainable_policy())
    model.to_empty(device="cpu")
    model.tie_weights()
    named = list(named_parameters([model]))
    if path.is_file():
        weights = whole_weights(loop)
        missing = sorted(n for n, _ in named if n not in weights)
        if missing:
            raise KeyError(f"{path}: {len(missing)} model tensor(s) missing, e.g. {missing[:5]}")
        for name, p in named:
            copy_full(p.data, weights[name], name, path)
    else:
        dcp.load(path, named, None)
    tensors = ((k, v if dtype is None else v.to(dtype)) for k, v in merged_state_dict(model).items())
    meta = {
        "stage": cfg.stage,
        "image_aspect_ratio": cfg.model.data.image_aspect_ratio,
        "conv_template": cfg.model.data.conv_template,
        "source": {"kind": "step-checkpoint", "path": str(path), "step": step},
    }
    log.info("step checkpoint %s (step %d) → neva checkpoint %s", path, step, out)
    return neva_format.save_checkpoint(out, source.cfg, tensors, source.tokenizer, metadata=meta, overwrite=overwrite)


@contextlib.contextmanager
def as_neva_checkpoint(path: str | os.PathLike) -> Iterator[Path]:
    """``path`` itself when it is a neva checkpoint directory, else the step checkpoint materialised in a temporary
    directory (removed on exit)."""
    if not is_step_checkpoint(path) or neva_format.is_neva_checkpoint(path):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="neva-step-") as tmp:
        yield materialize(path, Path(tmp) / "model")
