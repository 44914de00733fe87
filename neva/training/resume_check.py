"""What a resumed run may change: the config recorded in a checkpoint against this run's.

Every checkpoint records the run's resolved config (as JSON text, so any loader reads it as plain data). On resume,
changes that alter what is trained (the model, the stage, the data, the global batch, the seed, LoRA) stop the run
before any tensor is loaded, with every difference listed, unless ``exp_manager.resume_ignore_config_changes=true``;
the other changes are applied (the optimizer and the schedule are rebuilt from this run's config, the layout and the
precision may differ by design) and logged, one line per key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from neva.checkpoint.verified import CONFIG_KEY
from neva.config import TrainConfig
from neva.typed import ConfigError

log = logging.getLogger(__name__)


APPLIED = (
    "trainer.",  # steps, logging, validation, clipping, precision, devices
    "exp_manager.",  # loggers, checkpoint interval
    "cluster.",  # hardware description (MFU, planner)
    "model.optim.",  # AdamW and the schedule: rebuilt from this run's config, lr recomputed at the saved step
    # the layout: neva resumes across layouts (the global batch, checked below, fixes the samples of each step)
    "model.micro_batch_size",
    "model.tensor_model_parallel_size",
    "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.context_parallel_size",
    "model.pipeline_schedule",
    "model.pipeline_first_stage_layers",
    "model.sequence_parallel",
    "model.data_parallel",
    "model.zero_stage",
    "model.megatron_amp_O2",
    "model.activations_checkpoint_granularity",
    "model.activations_checkpoint_num_layers",
    "model.activation_offload",
    "model.fsdp_offload",
    "model.compile",
    "model.meta_init",
    "model.distributed_timeout_minutes",
    "model.eval.",  # benchmarks answered during training: the trained weights do not depend on them
    # data settings that change neither the training samples nor their order
    "model.data.num_workers",
    "model.data.max_tokens_per_micro_batch",  # the same samples per step, in other micro-batches
    "model.data.max_skip_fraction",
    "model.data.skip_check_min_samples",
    "model.data.validation_data_path",
    "model.data.synthetic_val_samples",
)
"""Keys (``.``-terminated: every key below) whose change a resume applies; any other change alters what is trained."""

TRAINING_SETTINGS = (
    "model.optim.",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.gradient_clip_val",
    "trainer.precision",
    "model.megatron_amp_O2",
)
"""Applied keys that set how the steps train: a finished run (nothing left to train) refuses their change too, since
resuming it would train nothing under them and rewrite its ``final`` as if it had (a sweep over the learning rate into
one ``exp_dir`` did exactly that)."""

NOT_COMPARED = ("recipe.",)
"""The stage file interpolates the recipe into ``model.*`` and ``trainer.*``, where its values are compared."""


def config_record(cfg: TrainConfig) -> str:
    """The config as a checkpoint records it."""
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def _is(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def _leaves(cfg: Any, saved: Any, path: str = ""):
    """``(key, saved value, current value)`` for every leaf field of the schema; values are compared whole (a
    dictionary field such as ``arch_overrides`` is one value). A field the saved config lacks (written before the key
    existed) is not compared."""
    for f in dataclasses.fields(cfg):
        key, value = f"{path}{f.name}", getattr(cfg, f.name)
        if not isinstance(saved, dict) or f.name not in saved:
            continue
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, saved[f.name], key + ".")
        else:
            yield key, saved[f.name], json.loads(json.dumps(value, default=dataclasses.asdict))  # lists of dataclasses


def config_changes(saved: dict[str, Any], cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every compared key whose value differs."""
    return [(k, old, new) for k, old, new in _leaves(cfg, saved) if old != new and not _is(k, NOT_COMPARED)]


def _line(key: str, old: Any, new: Any) -> str:
    return f"{key}: {json.dumps(old, sort_keys=True)} → {json.dumps(new, sort_keys=True)}"


def check_resume(checkpoint: dict[str, Any], cfg: TrainConfig, path: str | Path, log_changes: bool = True) -> None:
    """Refuse a resume whose config changes what is trained; log the changes that are applied.

    Raises:
        ConfigError: naming every changed key that alters what is trained (old → new), unless
            ``exp_manager.resume_ignore_config_changes`` is set.
    """
    record = checkpoint.get(CONFIG_KEY)
    if record is None:
        if log_changes:
            log.warning("%s records no config (written by an older neva): changes since then are not checked", path)
        return
    saved = json.loads(record)
    changes = config_changes(saved, cfg)
    altering = [c for c in changes if not _is(c[0], APPLIED)]
    ignore = cfg.exp_manager.resume_ignore_config_changes
    step = checkpoint.get("global_step", 0)
    extended = cfg.trainer.max_steps > saved.get("trainer", {}).get("max_steps", cfg.trainer.max_steps)
    finished = not extended and (step >= cfg.trainer.max_steps or (Path(cfg.exp_manager.exp_dir) / "final").is_dir())
    settings = [c for c in changes if _is(c[0], TRAINING_SETTINGS)]
    if finished and settings and not altering and not ignore:
        lines = "\n".join(f"  {_line(*c)}" for c in settings)
        raise ConfigError(
            f"{path} belongs to a finished run (checkpoint at step {step}, trainer.max_steps={cfg.trainer.max_steps}, "
            f"final checkpoint in {cfg.exp_manager.exp_dir}): resuming it with these changes would not train them:\n"
            f"{lines}\nTrain into a new exp_manager.exp_dir (a Hydra multirun gives each job its own), raise "
            "trainer.max_steps to continue training, or set exp_manager.resume_ignore_config_changes=true."
        )
    if altering and not ignore:
        lines = "\n".join(f"  {_line(*c)}" for c in altering)
        raise ConfigError(
            f"{path} was written with another config, and these changes alter what is trained:\n{lines}\n"
            "Resume with the values it was written with, train into a new exp_manager.exp_dir, or set "
            "exp_manager.resume_ignore_config_changes=true to continue with the new values anyway."
        )
    if not log_changes:
        return
    for change in changes:
        if _is(change[0], APPLIED):
            log.info("resume at step %s, changed since the checkpoint and applied: %s", step, _line(*change))
        else:
            log.warning(
                "resume at step %s, changed since the checkpoint, accepted by "
                "exp_manager.resume_ignore_config_changes=true: %s",
                step,
                _line(*change),
            )
