"""Per-rank memory: parameters, gradients, optimizer state (exact, from the parameter inventory), plus estimates of
FSDP working buffers and activations.

Bytes per element (trainable / frozen):

============  =======================================  ========  ===========================
precision     parameters at rest                       grads     AdamW state
============  =======================================  ========  ===========================
``o2``        bf16 + fp32 master (6) / bf16 (2);        fp32 (4)  2 × fp32 (8)
              under FSDP the sharded fp32 master is
              the parameter (4) and the bf16 copy is a
              transient all-gather buffer; FSDP keeps
              frozen shards fp32 too (4)
``fp32``      fp32 (4) / fp32 (4)                       fp32 (4)  2 × fp32 (8)
``half``      fp16 (2) / fp16 (2)                       fp16 (2)  2 × fp16 (4)
============  =======================================  ========  ===========================

Frozen parameters get no gradient and no optimizer state; AdamW also keeps a 4-byte ``step`` tensor per trainable
parameter tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from neva.parallel.layout import Layout
from neva.planner.deployment import Deployment
from neva.planner.params import ParamInfo, local_numel, on_stage, tp_numel

_STEP_BYTES = 4  # AdamW's float32 scalar ``step`` per parameter tensor


@dataclass(frozen=True)
class StateBytes:
    """Model state one rank holds at rest."""

    params: int
    grads: int
    optimizer: int


def bytes_per_element(dep: Deployment, trainable: bool) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per locally stored element."""
    if dep.precision == "o2":
        if not trainable:
            # FSDP2's mixed precision gathers bf16 from fp32 shards, frozen or not (measured by the rehearsal).
            return (4 if dep.fsdp else 2), 0, 0
        return (4 if dep.fsdp else 6), 4, 8
    size = 4 if dep.precision == "fp32" else 2
    return (size, size, 2 * size) if trainable else (size, 0, 0)


def rank_state_bytes(
    infos: list[ParamInfo], dep: Deployment, stage: int, layers: list[list[int]], tp_rank: int = 0, dp_rank: int = 0
) -> StateBytes:
    """Exact parameter / gradient / optimizer bytes of the rank at (stage, dp_rank, tp_rank) after one step."""
    params = grads = optimizer = 0
    for p in infos:
        if not on_stage(p, stage, layers):
            continue
        n = local_numel(p, dep.layout, tp_rank, dp_rank)
        pb, gb, ob = bytes_per_element(dep, p.trainable)
        params += n * pb
        grads += _grad_numel(p, dep.layout, n) * gb
        if p.trainable:
            optimizer += n * ob + _STEP_BYTES
    return StateBytes(params, grads, optimizer)


def _grad_numel(info: ParamInfo, layout: Layout, local: int) -> int:
    """Gradient elements of a parameter stored with ``local`` elements.

    DTensor's embedding backward (torch 2.13) returns a *replicated* weight gradient for the vocab-sharded
    embedding, so without FSDP (which reduce-scatters it to a shard) the gradient is full-size on every TP rank.
    """
    if info.part == "embedding" and layout.tp > 1 and not layout.sharded:
        return info.numel
    return local


def peak_grad_bytes(
    infos: list[ParamInfo], dep: Deployment, stage: int, layers: list[list[int]], at_rest: int, in_backward: float
) -> float:
    """Gradient bytes at the stage's peak, which falls early in a backward (measured by ``neva.plan
    plan.rehearse=true``). Under FSDP2 no gradient exists yet in the first micro-batch's backward (the previous
    step's were freed), and in every later micro-batch the unsharded fp32 gradients accumulated without reduction
    (``set_requires_gradient_sync(False)``) do: the whole TP-local trained stage, not a dp shard. The sharded
    ``at_rest`` gradients count instead when they outweigh the backward's ``in_backward`` bytes. Without FSDP the
    gradients of the previous micro-batch (or O2's persistent main-grad buffer) are there: ``at_rest``."""
    if not dep.fsdp:
        return at_rest
    accumulated = 0.0
    if dep.layout.grad_accum > 1:
        grad = 2 if dep.precision == "half" else 4
        accumulated = grad * sum(tp_numel(p, dep.layout) for p in infos if p.trainable and on_stage(p, stage, layers))
    return accumulated if accumulated + in_backward >= at_rest else at_rest


def working_bytes(infos: list[ParamInfo], dep: Deployment, stage: int, layers: list[list[int]]) -> float:
    """Transient FSDP buffers: all-gathered compute copies of parameters and unsharded gradients before the
    reduce-scatter (ZeRO-3: two decoder blocks plus the root unit, which ``neva.parallel`` never reshards: embedding,
    LM head, norm, projector, vision tower; ZeRO-2: every parameter of the stage stays gathered)."""
    layout = dep.layout
    if not dep.fsdp:
        return 0.0
    compute = 2 if dep.precision in ("o2", "half") else 4
    grad = 2 if dep.precision == "half" else 4
    units: dict[str, int] = {}
    trainable_units: dict[str, int] = {}
    for p in infos:
        if not on_stage(p, stage, layers):
            continue
        key = (
            f"layer{p.layer}"
            if p.part == "layer"
            else ("root" if p.part in ("embedding", "output", "norm") else p.part)
        )
        n = tp_numel(p, layout)
        units[key] = units.get(key, 0) + n
        if p.trainable:
            trainable_units[key] = trainable_units.get(key, 0) + n
    if not units:
        return 0.0
    largest_grad = max(trainable_units.values(), default=0) * grad
    if layout.zero_stage == 2:
        return sum(units.values()) * compute + largest_grad
    largest = max(v for k, v in units.items() if k != "root") if len(units) > 1 else 0
    return (units.get("root", 0) + 2 * largest) * compute + largest_grad
