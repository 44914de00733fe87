"""A run's step checkpoints as whole models: what ``neva.convert``, ``neva.generate`` and ``neva.evaluate`` read.

A training checkpoint is a one-process Lightning file (``<exp_dir>/checkpoints/step=N.ckpt``, ``last.ckpt``) or a
distributed run's DCP directory of the same names. Each records the run's resolved config (``CONFIG_KEY``), so the
architecture, tokenizer and LoRA setup are found there, exactly as the run built them (``resolve_source``). The
starting checkpoint is the one the run recorded (``start_record``: absolute path, sha256, refused when changed); the
checkpoint is verified against its manifest, its tensors are read as plain data (the file's, or DCP's pieces of every
rank), LoRA is merged as the end-of-stage export merges it, and the result is a neva checkpoint: the format every
reader of ``final`` takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint import dcp, neva_format, verified
from neva.checkpoint.initial_weights import copy_full
from neva.checkpoint.names import canonical_name, named_parameters
from neva.checkpoint.peft_adapter import save_peft_adapter
from neva.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from neva.checkpoint.source import ModelSource, resolve_source
from neva.checkpoint.start_record import START_KEY, recorded_start
from neva.config import TrainConfig
from neva.models.lora import merged_state_dict, split_state_dict
from neva.models.neva import NevaModel
from neva.models.trainable import build_meta_model
from neva.typed import ConfigError, build

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
    data["model"]["data"] = {k: recorded[k] for k in neva_format.RUN_DATA_KEYS if k in recorded}
    data["model"]["mm_cfg"]["pretrain_mm_mlp_adapter"] = None
    return build(TrainConfig, data)


@dataclasses.dataclass
class StepModel:
    """A step checkpoint loaded into a whole one-process model (LoRA layers as trained)."""

    model: NevaModel
    cfg: TrainConfig
    source: ModelSource
    path: Path
    step: int

    def metadata(self) -> dict[str, Any]:
        """The neva checkpoint metadata the end-of-stage export writes, and where the weights came from."""
        source = {"kind": "step-checkpoint", "path": str(self.path), "step": self.step}
        return {**neva_format.run_metadata(self.cfg), "source": source}

    def save(
        self, out: str | os.PathLike, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, overwrite: bool
    ) -> Path:
        """Write ``tensors`` (plain keys) as a neva checkpoint with this run's config, tokenizer and metadata."""
        pairs = ((k, v if dtype is None else v.to(dtype)) for k, v in tensors.items())
        return neva_format.save_checkpoint(
            out, self.source.cfg, pairs, self.source.tokenizer, metadata=self.metadata(), overwrite=overwrite
        )


def load_step_model(path: str | os.PathLike) -> StepModel:
    """Verify step checkpoint ``path``, rebuild the run's model from the config it records and load its tensors.

    Raises:
        ConfigError: ``path`` is a NeMo checkpoint (``.nemo``), with what to do.
        verified.CheckpointError: no or wrong manifest (an interrupted save, a corrupt file), no recorded config, or
            content other than tensors and plain data.
        KeyError: a model tensor the checkpoint lacks.
        ValueError: a tensor whose shape is not the model's.
    """
    neva_format.refuse_nemo_checkpoint(path)
    path = Path(path)
    step = verified.verify(path)
    loop = verified.load_state(path if path.is_file() else path / DCP_LOOP_STATE)
    cfg = recorded_config(loop, path)
    start = recorded_start(loop.get(START_KEY), path)
    if start is not None:  # the start the run resolved, not the recorded config's (relative / default) one again
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, restore_from_path=start))
    try:
        source = resolve_source(cfg)
    except ConfigError as err:
        raise ConfigError(
            f"{path}: the run's tokenizer and architecture come from where it started, as its recorded config says, "
            f"and that cannot be read now: {err}"
        ) from err
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
    return StepModel(model.eval(), cfg, source, path, step)


def materialize(
    path: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype | None = None, overwrite: bool = False
) -> Path:
    """Write step checkpoint ``path`` (``step=N.ckpt`` / ``last.ckpt``: a one-process file or a DCP directory) as a
    neva checkpoint directory ``out``, LoRA merged; ``dtype`` None keeps fp32 (as the end-of-stage export writes).

    Raises:
        see ``load_step_model``.
    """
    loaded = load_step_model(path)
    log.info("step checkpoint %s (step %d) → neva checkpoint %s", path, loaded.step, out)
    return loaded.save(out, merged_state_dict(loaded.model), dtype, overwrite)


def export_peft(
    path: str | os.PathLike,
    hf_out: str | os.PathLike,
    adapter_out: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> tuple[Path, Path]:
    """A LoRA run's step checkpoint → the llava-hf (Qwen-VL: its own family's) base (LoRA not merged, the trained projector in it) in ``hf_out``
    and a PEFT adapter in ``adapter_out`` (the LoRA layers, plus the parts trained besides them as
    ``modules_to_save``, so it also applies to the export of the checkpoint the run started from).

    Raises:
        ValueError: the run trained without LoRA.
    """
    from neva.checkpoint.interop import interop_for

    loaded = load_step_model(path)
    base, lora_layers = split_state_dict(loaded.model)
    if not lora_layers:
        raise ValueError(f"{path}: the run trained without LoRA (model.peft.peft_scheme); export it merged instead")
    policy = loaded.cfg.model.trainable_policy()
    trained = [part for part, on in (("vision", policy.vision), ("projector", policy.projector)) if on]
    saved = {part: {k: v for k, v in base.items() if k.startswith(part + ".")} for part in trained}
    interop = interop_for(loaded.source.cfg)  # the base exports as its family does, its parts under its names
    names = interop.adapter_names(loaded.source.cfg)
    with tempfile.TemporaryDirectory(prefix="neva-base-") as tmp:
        base_ckpt = loaded.save(Path(tmp) / "base", base, None, False)
        hf = interop.export(base_ckpt, hf_out, dtype=dtype, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    key, modules = names or (None, None)
    adapter = save_peft_adapter(
        adapter_out, lora_layers, saved, dtype=dtype, overwrite=overwrite, saved_key=key, saved_modules=modules
    )
    return hf, adapter


@contextlib.contextmanager
def as_neva_checkpoint(path: str | os.PathLike) -> Iterator[Path]:
    """``path`` itself when it is a neva checkpoint directory, else the step checkpoint materialised (or the HF
    directory imported: ``hf_start``) in a temporary directory (removed on exit).

    Raises:
        ConfigError: ``path`` is a NeMo checkpoint.
    """
    neva_format.refuse_nemo_checkpoint(path)
    from neva.checkpoint.hf_start import as_imported, hf_model_type

    if hf_model_type(path) is not None:  # an HF directory of a family neva imports: imported on the fly
        with as_imported(path) as imported:
            yield imported
        return
    if not is_step_checkpoint(path) or neva_format.is_neva_checkpoint(path):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="neva-step-") as tmp:
        yield materialize(path, Path(tmp) / "model")
