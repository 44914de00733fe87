"""The layout a preset ships: the planner's fastest fitting data-parallel mode, ZeRO stage, activation checkpointing
and context-parallel size for the recipe's own model parallelism and micro-batch, and how that layout scales to 16
nodes. A video preset (``model.data.media_type: video``) is planned on its own samples: one video of
``model.data.num_frames`` frames each (``preset_frames``).

The recipe keeps what changes the update or names the published layout (TP, PP, virtual PP, SP, EP and the micro
-batch: under ``loss_normalization: micro_batch_mean`` the loss is a mean per micro-batch, so another micro-batch is
another update); the planner decides what only changes speed and memory (``DECIDED``). docs/PRESETS.md, "Layouts the
planner chose", lists each preset's choice and, where a free micro-batch would be faster, both figures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from neva.config import TrainConfig
from neva.planner.plan import Plan, plan_run
from neva.planner.search import search
from neva.typed import ConfigError

# model.* keys a preset takes from the planner (speed and memory only, the same update).
DECIDED = ("data_parallel", "zero_stage", "activations_checkpoint_granularity", "context_parallel_size")
# model.* keys a preset takes from its recipe: the published model parallelism and the loss's micro-batch.
KEPT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "sequence_parallel",
    "expert_model_parallel_size",
    "micro_batch_size",
)
SCALE_NODES = 16  # the node count NVIDIA's NeVA scaling table reaches


@dataclass(frozen=True)
class Scaling:
    """Weak scaling of one layout (``neva.plan trainer.num_nodes=<base>,<nodes>``: the global batch grows with the
    nodes): throughput at ``nodes`` over throughput at ``base``."""

    base: int
    nodes: int
    speedup: float

    @property
    def efficiency(self) -> float:
        return self.speedup / (self.nodes / self.base)


def preset_frames(cfg: TrainConfig) -> int | None:
    """Frames of the sample a preset is planned on: its ``model.data.num_frames`` for a video run, else None (one
    image per sample)."""
    return cfg.model.data.num_frames if cfg.model.data.media_type == "video" else None


def with_layout(cfg: TrainConfig, **model: object) -> TrainConfig:
    """``cfg`` with some ``model.*`` layout keys replaced."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def at_nodes(cfg: TrainConfig, nodes: int) -> TrainConfig:
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, num_nodes=nodes))


def scaling(cfg: TrainConfig, nodes: int = SCALE_NODES) -> Scaling:
    """How ``cfg``'s layout scales from one node (or, when the layout needs more GPUs than a node has, from its own
    node count) to ``nodes`` at the same per-node batch, as ``neva.plan``'s weak-scaling sweep computes it."""
    for base in dict.fromkeys((1, cfg.trainer.num_nodes)):
        try:
            first = plan_run(at_nodes(cfg, base), num_frames=preset_frames(cfg))
        except ConfigError:
            continue
        if nodes % base == 0:
            gbs = first.deployment.layout.global_batch_size * nodes // base
            last = plan_run(at_nodes(cfg, nodes), global_batch_size=gbs, num_frames=preset_frames(cfg))
            return Scaling(base, nodes, last.samples_per_s / first.samples_per_s)
    raise ConfigError(f"no node count of (1, {cfg.trainer.num_nodes}) plans this layout and divides {nodes}")


def _decided(plan: Plan) -> dict[str, object]:
    layout = plan.deployment.layout
    return {
        "data_parallel": layout.data_parallel,
        "zero_stage": layout.zero_stage,
        "activations_checkpoint_granularity": layout.ac,
        "context_parallel_size": layout.cp,
        "micro_batch_size": layout.micro_batch_size,
    }


def fastest_layout(cfg: TrainConfig, keep_micro_batch: bool = True) -> tuple[dict[str, object], Plan]:
    """The planner's fastest fitting choice of ``DECIDED`` (and the micro-batch unless ``keep_micro_batch``) at
    ``cfg``'s nodes, with the other layout keys as ``cfg`` has them, and its plan.

    Layouts of equal predicted speed (one data-parallel rank makes ZeRO-2 and ZeRO-3 the same step) go to the one
    faster at ``SCALE_NODES`` nodes: the preset is also the starting point of every larger run.

    Raises:
        ConfigError: no layout fits.
    """
    kept = KEPT if keep_micro_batch else KEPT[:-1]
    found = search(cfg, {k: [getattr(cfg.model, k)] for k in kept}, top=0, num_frames=preset_frames(cfg))
    if not found.plans:
        raise ConfigError(f"no layout of {kept} as configured fits ({found.valid} of {found.tried} valid)")
    best = found.plans[0].samples_per_s
    tied = [p for p in found.plans if p.samples_per_s == best]
    choices = [(_decided(p), p) for p in tied]
    if len(choices) > 1:
        choices.sort(key=lambda c: -_speedup(with_layout(cfg, **c[0])))
    return choices[0]


def _speedup(cfg: TrainConfig) -> float:
    """``scaling``'s speed-up, 0 for a layout that plans on the preset's GPUs but is refused on more (a one-GPU
    preset's DDP under O2: equal to FSDP2 on one rank, refused on many)."""
    try:
        return scaling(cfg).speedup
    except ConfigError:
        return 0.0
