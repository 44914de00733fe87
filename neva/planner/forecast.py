"""The start-of-run forecast: one line that says how the run's own layout will do before it spends the allocation.

``neva.train`` hands ``forecast_line`` to ``neva.training.run.run``, whose rank 0 logs it: the planner's step time,
samples/s and MFU for the configured layout (the numbers ``python -m neva.plan`` prints for the same config), the
scaling efficiency against one node at the same per-node batch (multi-node runs), and the fastest fitting layout
``neva.plan``'s search finds when it is at least ``FASTER`` times faster; for a layout that does not fit, each offload knob
with the device memory it saves (``offload_savings``). A cluster without a known GPU peak (the
``local`` preset, CPU runs) gets no numbers: an MFU against a made-up peak would mislead.
"""

from __future__ import annotations

import dataclasses

from neva.config import TrainConfig
from neva.planner.hardware import hardware_from_config
from neva.planner.plan import GiB, Plan, plan_run
from neva.planner.search import offload_options, search
from neva.typed import ConfigError

FASTER = 1.2  # a layout is named when the search predicts at least this speed-up (20 %)


def _layout_text(plan: Plan) -> str:
    lay = plan.deployment.layout
    dp_mode = f"FSDP ZeRO-{lay.zero_stage}" if lay.data_parallel == "fsdp" else "DDP"
    pp = f"{lay.pp}x{lay.vpp}" if lay.vpp > 1 else str(lay.pp)
    offload = [name for name, on in (("activations", lay.activation_offload), ("FSDP2 state", lay.fsdp_offload)) if on]
    return (
        f"TP {lay.tp}{'+SP' if lay.sp else ''} PP {pp} DP {lay.dp}{f' EP {lay.ep}' if lay.ep > 1 else ''} {dp_mode}, "
        f"checkpointing {lay.ac or 'none'}, micro-batch {lay.micro_batch_size}, global batch {lay.global_batch_size}"
        + (f", offload {' + '.join(offload)}" if offload else "")
    )


def _overrides(cfg: TrainConfig, plan: Plan) -> str:
    """The ``model.*`` overrides that turn ``cfg``'s layout into ``plan``'s (only the keys that differ)."""
    lay = plan.deployment.layout
    values = {
        "tensor_model_parallel_size": lay.tp,
        "pipeline_model_parallel_size": lay.pp,
        "virtual_pipeline_model_parallel_size": lay.vpp if lay.vpp > 1 else None,
        "sequence_parallel": lay.sp,
        "data_parallel": lay.data_parallel,
        "zero_stage": lay.zero_stage,
        "expert_model_parallel_size": lay.ep,
        "context_parallel_size": lay.cp,
        "activations_checkpoint_granularity": lay.ac,
        "micro_batch_size": lay.micro_batch_size,
        "activation_offload": lay.activation_offload,
        "fsdp_offload": lay.fsdp_offload,
    }
    changed = [(k, v) for k, v in values.items() if getattr(cfg.model, k) != v]
    return " ".join(f"model.{k}={'null' if v is None else str(v).lower()}" for k, v in changed)


def scaling_efficiency(cfg: TrainConfig, plan: Plan) -> float | None:
    """``plan``'s samples/s over ``nodes`` × one node's at the same per-node global batch (None: one node, or no
    one-node layout of the same sizes)."""
    nodes = cfg.trainer.num_nodes
    gbs = plan.deployment.layout.global_batch_size
    if nodes == 1 or gbs % nodes:
        return None
    one = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, num_nodes=1))
    try:
        single = plan_run(one, global_batch_size=gbs // nodes)
    except ConfigError:  # the layout needs more GPUs than a node has (TP x PP x EP), or the batch does not split
        return None
    return plan.samples_per_s / (nodes * single.samples_per_s)


def offload_savings(cfg: TrainConfig, own: Plan) -> list[str]:
    """For a layout that does not fit: each offload knob not on yet (and both together), the device memory it saves
    and the host memory it needs, whether it then fits, and its predicted step (``neva.planner.offload``)."""
    out = []
    for knobs in offload_options(cfg):
        changed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **dict.fromkeys(knobs, True)))
        try:
            plan = plan_run(changed)
        except ConfigError:
            continue  # a knob this layout refuses (FSDP2's offload under DDP)
        saved = (own.peak.total - plan.peak.total) / GiB
        keys = " ".join(f"model.{k}=true" for k in knobs)
        verdict = "fits" if plan.fits else "still does not fit"
        out.append(
            f"{keys} saves {saved:.1f} GiB of device memory ({plan.peak.host / GiB:.1f} GiB on the host): "
            f"{plan.peak.total / GiB:.1f} GiB, {verdict}, {plan.time.step:.4g} s/step"
        )
    return out


def forecast_line(cfg: TrainConfig) -> str:
    """One line: the planner's prediction for ``cfg``'s layout, and a faster fitting layout if the search finds one."""
    try:
        hardware_from_config(cfg.cluster)
    except ConfigError:
        return (
            f"plan: no prediction for cluster={cfg.cluster.name} (GPU {cfg.cluster.gpu_name!r} has no known peak); "
            "give cluster=dgx_h100 / dgx_a100 or cluster.peak_tflops_bf16 for step time, MFU and scaling"
        )
    try:
        own = plan_run(cfg)
    except ConfigError as err:
        return f"plan: the planner cannot plan this layout ({err})"
    where = f"{cfg.trainer.num_nodes} x {cfg.cluster.name}"
    parts = [
        f"plan: {_layout_text(own)} on {where}: {own.time.step:.4g} s/step, {own.samples_per_s:.1f} samples/s, "
        f"MFU {100 * own.mfu:.1f}%, peak {own.peak.total / GiB:.1f}/{own.gpu_memory_gb:.0f} GiB"
        + ("" if own.fits else " (does NOT fit)")
    ]
    if not own.fits:
        parts.extend(offload_savings(cfg, own))
    efficiency = scaling_efficiency(cfg, own)
    if efficiency is not None:
        parts.append(f"scaling efficiency {100 * efficiency:.0f}% of {cfg.trainer.num_nodes} x one node")
    best = search(cfg, top=1).plans
    if best and best[0].samples_per_s >= FASTER * own.samples_per_s:
        b = best[0]
        parts.append(
            f"the layout search finds {_layout_text(b)} {b.samples_per_s / own.samples_per_s:.2f}x faster "
            f"({b.time.step:.4g} s/step, fits in {b.peak.total / GiB:.1f} GiB): {_overrides(cfg, b)}"
        )
    else:
        parts.append(f"no fitting layout is {100 * (FASTER - 1):.0f}% faster (neva.plan plan.search)")
    return "; ".join(parts)
