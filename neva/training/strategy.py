"""The Lightning strategy for a run's layout (one process here; the distributed engine extends this)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.utilities.load import _METADATA_FILENAME
from pytorch_lightning.strategies import SingleDeviceStrategy, Strategy

from neva.training.config import TrainConfig
from neva.typed import ConfigError


@dataclass(frozen=True)
class Layout:
    """Process layout: world = pp × dp × tp; this process's data-parallel coordinates."""

    world: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    dp_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world > 1


def resolve_layout(cfg: TrainConfig) -> Layout:
    """One process unless the distributed engine is available and configured (see ``neva.parallel``)."""
    try:
        from neva.parallel.layout import resolve_layout as resolve_distributed
    except ImportError:
        resolve_distributed = None
    if resolve_distributed is not None:
        return resolve_distributed(cfg)
    if cfg.model.tensor_model_parallel_size * cfg.model.pipeline_model_parallel_size > 1:
        raise ConfigError("tensor/pipeline parallelism needs the distributed engine (neva.parallel)")
    return Layout()


def build_strategy(cfg: TrainConfig, layout: Layout) -> Strategy | str:
    if layout.is_distributed:
        from neva.parallel.strategy import build_distributed_strategy

        return build_distributed_strategy(cfg, layout)
    device = torch.device("cuda", 0) if _use_cuda(cfg) else torch.device("cpu")
    return NevaSingleDeviceStrategy(device=device)


class NevaSingleDeviceStrategy(SingleDeviceStrategy):
    """One process. Besides its own checkpoint files it resumes the DCP checkpoint directories of distributed runs
    (DCP gathers the shards of any layout into this process's full tensors), so a run may continue on one device."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device=device)
        self._loaded_dcp = False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # DCP loads into the optimizer's state, which exists only after setup

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not path.is_dir():
            return super().load_checkpoint(checkpoint_path, weights_only)
        from neva.checkpoint import dcp

        engine = self.lightning_module.engine
        if engine.master is not None:
            raise ConfigError(
                f"{path} was written by a distributed run; resuming it in one process with model.megatron_amp_O2=true "
                "is not supported (resume with the FSDP layout, or without O2)"
            )
        optimizer = self.optimizers[0] if self.optimizers else None
        dcp.load(path, [engine.model], getattr(optimizer, "_optimizer", optimizer))
        checkpoint = torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=False)
        restore_schedules(self.lightning_module.trainer, checkpoint)
        self._loaded_dcp = True
        return checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._loaded_dcp  # DCP already filled the optimizer state in place

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self._loaded_dcp:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self._loaded_dcp:
            super().load_optimizer_state_dict(checkpoint)


def restore_schedules(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Keep only the step count of saved schedulers and recompute this rank's learning rates from it.

    A pipeline stage may hold other parameter groups than rank 0 (which wrote the metadata), and a new layout may
    differ again, so the saved per-group lists cannot be loaded as they are.
    """
    saved = checkpoint.get("lr_schedulers", [])
    for i, (config, state) in enumerate(zip(trainer.lr_scheduler_configs, saved)):
        scheduler = config.scheduler
        last = state["last_epoch"]
        fresh = scheduler.state_dict()
        fresh.update(last_epoch=last, _step_count=state.get("_step_count", last + 1))
        lrs = [base * fn(last) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        fresh["_last_lr"] = lrs
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        saved[i] = fresh


def _use_cuda(cfg: TrainConfig) -> bool:
    accel = cfg.trainer.accelerator
    if accel == "cpu":
        return False
    if accel in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator=gpu but no CUDA device is visible")
    return torch.cuda.is_available()
