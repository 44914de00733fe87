"""Process layout from the config and the launcher's environment: world = pp × dp × tp."""

from __future__ import annotations

import os

import torch

from neva.training.config import TrainConfig
from neva.training.strategy import Layout
from neva.typed import ConfigError


def world_size(cfg: TrainConfig) -> int:
    """Processes in the run: torchrun's ``WORLD_SIZE``, SLURM's ``SLURM_NTASKS``, else devices × nodes.

    The last case is Lightning's own launcher (``trainer.devices=N``): the main process starts before the others
    exist, so the size comes from the config.
    """
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if var in os.environ:
            return int(os.environ[var])
    devices = cfg.trainer.devices
    if devices == "auto":
        per_node = torch.cuda.device_count() if torch.cuda.is_available() and cfg.trainer.accelerator != "cpu" else 1
    elif isinstance(devices, (list, tuple)):
        per_node = len(devices)
    else:
        per_node = int(devices)
    return max(1, per_node) * cfg.trainer.num_nodes


def global_rank(per_node: int = 1) -> int:
    """This process's rank as the launcher tells it (0 for the main process of Lightning's launcher)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or per_node
    return node * per_node + local


def mesh_coords(rank: int, layout: Layout) -> tuple[int, int, int]:
    """``(pp, dp, tp)`` coordinates of ``rank`` in the row-major mesh ``("pp", "dp", "tp")`` (tp fastest)."""
    return rank // (layout.dp * layout.tp), (rank // layout.tp) % layout.dp, rank % layout.tp


def resolve_layout(cfg: TrainConfig) -> Layout:
    """The run's layout; a world size that ``tp × pp`` does not divide is a config error.

    Tensor parallelism is the fastest-varying mesh dimension so a TP group stays inside a node (NVLink); pipeline
    stages are the slowest, so only point-to-point activations cross the slower links.
    """
    tp = cfg.model.tensor_model_parallel_size
    pp = cfg.model.pipeline_model_parallel_size
    world = world_size(cfg)
    if world % (tp * pp):
        raise ConfigError(
            f"world size {world} is not divisible by model.tensor_model_parallel_size ({tp}) × "
            f"model.pipeline_model_parallel_size ({pp}); choose sizes whose product divides the number of processes"
        )
    vpp = cfg.model.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and pp == 1:
        raise ConfigError("model.virtual_pipeline_model_parallel_size needs model.pipeline_model_parallel_size > 1")
    if pp == 1 and cfg.model.pipeline_schedule == "interleaved_1f1b":
        raise ConfigError("model.pipeline_schedule=interleaved_1f1b needs model.pipeline_model_parallel_size > 1")
    layout = Layout(world=world, tp=tp, pp=pp, dp=world // (tp * pp))
    if world == 1:
        return layout
    _, dp_rank, _ = mesh_coords(global_rank(world // cfg.trainer.num_nodes), layout)
    return Layout(world=world, tp=tp, pp=pp, dp=layout.dp, dp_rank=dp_rank)
