"""The Lightning strategy for a run's layout (one process here; the distributed engine extends this)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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
    return SingleDeviceStrategy(device=device)


def _use_cuda(cfg: TrainConfig) -> bool:
    accel = cfg.trainer.accelerator
    if accel == "cpu":
        return False
    if accel in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator=gpu but no CUDA device is visible")
    return torch.cuda.is_available()
