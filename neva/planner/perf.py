"""Step time of a layout: compute, TP collectives, pipeline bubble, exposed DP communication, optimizer, jitter.

::

    t_mb(stage)  = per-GPU FLOPs / (peak · compute) + TP all-reduces + pipeline sends       (one micro-batch)
                   + EP all-to-alls (MoE: k·H values per token, (ep − 1)/ep of them off the rank)
    t_pipe       = m · max_stage t_mb + (pp − 1) / v · mean_stage t_mb                        (1F1B bubble)
    t_dp         = max(comm − overlap window, (1 − dp_overlap) · comm)                       (exposed DP traffic)
    t_offload    = max(bus / pcie − overlap · compute, (1 − overlap) · bus / pcie)         (offload knobs' copies)
    t_step       = (t_pipe + t_dp + t_optimizer + t_offload) · (1 + jitter_cv · E[max of dp normals])
"""

from __future__ import annotations

from dataclasses import dataclass

from neva.models.config import NevaConfig
from neva.parallel.layout import Layout
from neva.planner.comm import (
    all_reduce_time,
    all_to_all_time,
    cp_group_per_node,
    dp_group_per_node,
    expected_max_normal,
    half_time,
    p2p_time,
    tp_group_per_node,
)
from neva.planner.deployment import Deployment
from neva.planner.flops import StageFlops, checkpointed_layers
from neva.planner.hardware import Hardware
from neva.planner.linear_attention import state_exchange_bytes
from neva.planner.moe import dispatch_bytes
from neva.planner.offload import exposed_bus_seconds, host_optimizer_seconds
from neva.planner.params import ParamInfo, local_numel, on_stage, tp_numel


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step and its parts (the slowest stage's view)."""

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_exposed: float
    dp_total: float
    optimizer: float
    jitter: float
    step: float
    ep_comm: float = 0.0  # expert-parallel all-to-alls (MoE), on the critical path: the experts wait for them
    cp_comm: float = 0.0  # context parallelism's key/value all-gathers (and their reduce-scatters), not overlapped
    offload: float = 0.0  # host <-> device copies of the offload knobs not hidden behind compute


def _tp_collectives(layout: Layout, layers: list[int], recomputed: frozenset[int], stage: int, backward: bool) -> int:
    """All-reduces (or RS + AG pairs under SP) per micro-batch on one stage."""
    if layout.tp == 1:
        return 0
    count = 0
    for i in layers:
        count += 2 + (2 if backward else 0) + (2 if backward and i in recomputed else 0)
    if stage == 0:
        count += 1  # vocab-parallel embedding
    if stage == layout.pp - 1 and backward:
        count += 1  # input gradient of the vocab-parallel LM head
    return count


def _all_to_alls(cfg: NevaConfig, layers: list[int], recomputed: frozenset[int], backward: bool) -> int:
    """Expert-parallel all-to-alls per micro-batch on one stage: dispatch and combine in each MoE layer's forward,
    their gradients in backward, the forward's again when full checkpointing recomputes the layer."""
    if not cfg.llm.is_moe:
        return 0
    moe = [i for i in layers if cfg.llm.is_moe_layer(i)]  # Llama 4's dense layers dispatch nothing
    return sum(2 + (2 if backward else 0) + (2 if backward and i in recomputed else 0) for i in moe)


def _cp_gathers(layout: Layout, layers: list[int], recomputed: frozenset[int], backward: bool) -> int:
    """Key/value all-gathers (or their backward reduce-scatters) per micro-batch on one stage: one per layer forward,
    one per layer backward, one more per fully recomputed layer."""
    if layout.cp == 1:
        return 0
    return sum(1 + backward + (backward and layout.ac == "full" and i in recomputed) for i in layers)


def _exposed(comm: float, window: float, overlap: float) -> float:
    """Seconds of ``comm`` left after hiding it behind ``window`` seconds of compute (never below 1 − overlap)."""
    return max(comm - window, (1 - overlap) * comm) if comm > 0 else 0.0


def _dp_comm(
    infos: list[ParamInfo], dep: Deployment, hw: Hardware, stage: int, layers: list[list[int]], compute_mb: float
) -> tuple[float, float]:
    """(total, exposed) seconds of data-parallel traffic per step on one stage.

    DDP all-reduces once per step while the last micro-batch runs backward (~2/3 of its compute). ZeRO-2 gathers the
    parameters once (hidden behind the first micro-batch's forward) and reduce-scatters once (gradient sync on the
    last micro-batch only). ZeRO-3 gathers for every forward and backward and reduce-scatters every micro-batch,
    all prefetched across the whole step.
    """
    layout = dep.layout
    if layout.dp_cp == 1:
        return 0.0, 0.0
    mine = [p for p in infos if on_stage(p, stage, layers)]
    grad_bytes = 2 if dep.grad_reduce == "bf16" else 4
    compute_bytes = 2 if dep.precision in ("o2", "half") else 4
    trained = sum(tp_numel(p, layout) for p in mine if p.trainable) * grad_bytes
    gathered = sum(tp_numel(p, layout) for p in mine) * compute_bytes
    per_node, m, ov = dp_group_per_node(dep), layout.grad_accum, hw.eff.dp_overlap
    backward, forward = 2 / 3 * compute_mb, 1 / 3 * compute_mb
    if layout.data_parallel == "ddp":
        reduce = all_reduce_time(trained, layout.dp_cp, per_node, hw)
        return reduce, _exposed(reduce, backward, ov)
    reduce_scatter = half_time(trained, layout.dp_cp, per_node, hw)
    gather = half_time(gathered, layout.dp_cp, per_node, hw)
    if layout.zero_stage == 2:
        return gather + reduce_scatter, _exposed(gather, forward, ov) + _exposed(reduce_scatter, backward, ov)
    total = m * (2 * gather + reduce_scatter)
    return total, _exposed(total, m * compute_mb, ov)


def step_time(
    cfg: NevaConfig,
    infos: list[ParamInfo],
    dep: Deployment,
    hw: Hardware,
    seq_len: int,
    layers: list[list[int]],
    flops: list[StageFlops],
    bus: list[float] | None = None,
) -> StepTime:
    """Predicted seconds per optimizer step (``bus``: each stage's host ↔ device bytes per step under the offload
    knobs, ``neva.planner.offload``)."""
    layout = dep.layout
    b, m, e = layout.micro_batch_size, layout.grad_accum, dep.compute_bytes
    act = e * b * seq_len * cfg.llm.hidden_size / layout.cp  # a rank's tokens: 1/cp of each row
    # the whole rows' keys and values of one layer, gathered over cp (each rank contributes 1/cp of them)
    kv = 2 * e * b * seq_len * cfg.llm.num_kv_heads * cfg.llm.head_dim / layout.tp
    rate = hw.peak_flops * hw.eff.compute
    # each of a rank's tokens (1/cp of each row) goes to its k experts and back (the dispatch carries k rows per token)
    routed = (
        dispatch_bytes(dep.precision) * b * seq_len / layout.cp * cfg.llm.hidden_size * (cfg.llm.moe_router_topk or 0)
    )
    comp, tp, p2p, a2a, cpc = [], [], [], [], []
    recomputed = checkpointed_layers(layout, cfg.llm.num_layers)
    for s, f in enumerate(flops):
        comp.append(f.per_gpu * b / rate)
        n = _tp_collectives(layout, layers[s], recomputed, s, f.backward)
        tp.append(n * all_reduce_time(act, layout.tp, tp_group_per_node(dep), hw))
        sends = 0 if layout.pp == 1 else (1 + f.backward) * layout.vpp
        p2p.append(sends * p2p_time(act, dep, hw) if sends else 0.0)  # one GPU (cluster=local): no link to time
        a2a.append(_all_to_alls(cfg, layers[s], recomputed, f.backward) * all_to_all_time(routed, dep, hw))
        gathers = _cp_gathers(layout, [i for i in layers[s] if not cfg.llm.is_linear_layer(i)], recomputed, f.backward)
        cpc.append(gathers * half_time(kv, layout.cp, cp_group_per_node(dep), hw) if gathers else 0.0)
        # linear-attention layers gather their chunks' end states and transitions instead (neva.planner.linear_attention)
        linear = _cp_gathers(layout, [i for i in layers[s] if cfg.llm.is_linear_layer(i)], recomputed, f.backward)
        if linear:
            states = state_exchange_bytes(cfg.llm, b, layout.tp, layout.cp)
            cpc[-1] += linear * half_time(states, layout.cp, cp_group_per_node(dep), hw)
    per_mb = [c + t + p + a + g for c, t, p, a, g in zip(comp, tp, p2p, a2a, cpc)]
    worst = max(range(len(per_mb)), key=per_mb.__getitem__)
    bubble = (layout.pp - 1) / layout.vpp * sum(per_mb) / len(per_mb) if layout.pp > 1 else 0.0
    pipe = m * per_mb[worst] + bubble

    dp_total, dp_exposed = max(_dp_comm(infos, dep, hw, s, layers, comp[s]) for s in range(layout.pp))

    # AdamW on the local shard: read/write fp32 master + 2 states, read the grad, write the compute copy.
    opt_elems = max(
        sum(local_numel(p, layout) for p in infos if p.trainable and on_stage(p, s, layers)) for s in range(layout.pp)
    )
    optimizer = opt_elems * 30 / (hw.eff.optimizer_gb_per_s * 1e9)
    offload = 0.0
    if layout.fsdp_offload:  # AdamW steps on the host instead
        optimizer = host_optimizer_seconds(opt_elems, dep, hw)
    if bus and max(bus) > 0:
        offload = exposed_bus_seconds(bus[worst], m * comp[worst], hw)

    base = pipe + dp_exposed + optimizer + offload
    jitter = base * hw.eff.jitter_cv * expected_max_normal(layout.dp)
    return StepTime(
        compute=m * comp[worst],
        tp_comm=m * tp[worst],
        pp_comm=m * p2p[worst],
        bubble=bubble,
        dp_exposed=dp_exposed,
        dp_total=dp_total,
        optimizer=optimizer,
        jitter=jitter,
        step=base + jitter,
        ep_comm=m * a2a[worst],
        cp_comm=m * cpc[worst],
        offload=offload,
    )
