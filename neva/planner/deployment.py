"""A run as the planner sees it: training's ``Layout`` plus the cluster and precision facts around it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from neva.config import TrainConfig
from neva.parallel.layout import Layout
from neva.parallel.parallelize import uses_fsdp
from neva.parallel.precision import Precision
from neva.typed import ConfigError

# fp16, which training refuses, is still planned: with O2 like bf16 O2 (2-byte parameters, fp32 master), ``16-mixed``
# as fp32 storage with half compute, ``16`` / ``16-true`` as pure half precision (every tensor 2 bytes).
_FP16 = ("16", "16-mixed", "16-true")


@dataclass(frozen=True)
class Deployment:
    """A ``Layout`` on ``nodes`` nodes of ``gpus_per_node`` GPUs, stored and computed in ``precision``.

    Attributes:
        layout: the training layout (sizes, schedule, data parallelism, activation checkpointing, batch).
        precision: ``o2`` (bf16 params + fp32 master/grads/Adam), ``fp32`` (fp32 params, grads, Adam; also bf16
            autocast, whose compute is bf16 but storage fp32) or ``half`` (every tensor 2 bytes: pure fp16).
        compute_bytes: bytes per element of activations and TP/PP messages.
        grad_reduce: dtype of data-parallel gradient reduction, ``fp32`` (neva's O2: FSDP2 ``reduce_dtype`` fp32)
            or ``bf16`` (Megatron-core's default, ``grad_reduce_in_fp32=False``).
    """

    layout: Layout
    nodes: int
    gpus_per_node: int
    precision: str
    compute_bytes: int
    grad_reduce: str = "fp32"

    @property
    def fsdp(self) -> bool:
        """Whether training wraps this layout in FSDP2 (the rule of ``neva.parallel.parallelize.uses_fsdp``)."""
        return uses_fsdp(self.layout, Precision(master_weights=self.precision == "o2"))

    def to_dict(self) -> dict:
        """The layout's sizes and plans with the cluster and precision facts, flat (what the JSON shows)."""
        facts = dataclasses.asdict(self.layout)
        for process_only in ("device_type", "dp_rank"):
            del facts[process_only]
        return {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            **facts,
            "precision": self.precision,
            "compute_bytes": self.compute_bytes,
            "grad_reduce": self.grad_reduce,
        }


def precision_kind(precision: str | int, megatron_amp_O2: bool) -> tuple[str, int]:
    """``(precision, compute_bytes)`` of ``Deployment`` for ``trainer.precision`` and ``model.megatron_amp_O2``:
    what training's ``Precision`` runs, and fp16 (which training refuses) as Megatron runs it.

    Raises:
        ConfigError: a combination neither training nor the fp16 model covers (``32`` with O2, unknown strings).
    """
    p = str(precision)
    if p in _FP16:
        if megatron_amp_O2:
            return "o2", 2
        return ("fp32", 2) if p == "16-mixed" else ("half", 2)
    try:
        policy = Precision.from_config(p, megatron_amp_O2)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if policy.master_weights:
        return "o2", 2
    return "fp32", 4 if policy.autocast_dtype is None else 2


def planned_gpus_per_node(cfg: TrainConfig) -> int:
    """``trainer.devices``, or the cluster's GPUs per node when it is not a number (``auto``)."""
    return cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else cfg.cluster.gpus_per_node


def planned_world(cfg: TrainConfig) -> int:
    """The GPUs a config plans for: ``planned_gpus_per_node`` times the nodes."""
    return cfg.trainer.num_nodes * planned_gpus_per_node(cfg)


def deployment_from_config(
    cfg: TrainConfig, global_batch_size: int | None = None, grad_reduce: str | None = None
) -> Deployment:
    """The deployment ``cfg`` describes; ``global_batch_size`` overrides the config's (weak-scaling sweeps) and
    ``grad_reduce`` the gradient-reduction dtype (default: bf16 for pure half-precision runs, else fp32).

    The run's start-time rules (O2 with DDP, micro-batches per pipeline stage, ...) are ``plan_run``'s
    ``check_run``, not this function's.

    Raises:
        ConfigError: what ``Layout.from_config`` refuses (tp × pp not dividing the world, a global batch not
            dividing into micro-batches × dp, pipeline options without PP), an unknown ``grad_reduce`` or precision.
    """
    model = cfg.model
    if global_batch_size is not None:
        model = dataclasses.replace(model, global_batch_size=global_batch_size)
    layout = Layout.from_config(model, planned_world(cfg))
    if grad_reduce not in (None, "fp32", "bf16"):
        raise ConfigError(f"grad_reduce must be fp32 or bf16, got {grad_reduce!r}")
    precision, compute = precision_kind(cfg.trainer.precision, model.megatron_amp_O2)
    return Deployment(
        layout=layout,
        nodes=cfg.trainer.num_nodes,
        gpus_per_node=planned_gpus_per_node(cfg),
        precision=precision,
        compute_bytes=compute,
        grad_reduce=grad_reduce or ("bf16" if precision == "half" else "fp32"),
    )
