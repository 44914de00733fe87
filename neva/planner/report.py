"""Human table and JSON of a list of plans."""

from __future__ import annotations

import json

from neva.planner.plan import GiB, Plan

_HEADER = (
    "nodes",
    "tp",
    "pp",
    "dp",
    "ep",
    "dp_mode",
    "ac",
    "offload",
    "mbs",
    "gbs",
    "params",
    "grads",
    "optim",
    "activ",
    "work",
    "host",
    "total_GiB",
    "fits",
    "step_s",
    "samples/s",
    "MFU",
)


def _row(plan: Plan) -> tuple[str, ...]:
    lay, peak = plan.deployment.layout, plan.peak
    dp_mode = f"zero{lay.zero_stage}" if lay.data_parallel == "fsdp" else "ddp"
    return (
        str(plan.deployment.nodes),
        str(lay.tp) + ("+sp" if lay.sp else ""),
        str(lay.pp) + (f"x{lay.vpp}" if lay.vpp > 1 else ""),
        str(lay.dp) + (f"+cp{lay.cp}" if lay.cp > 1 else ""),  # context parallelism beside the dp it multiplies
        str(lay.ep),
        dp_mode,
        lay.ac or "-",
        # a: activations (model.activation_offload), s: FSDP2's sharded state (model.fsdp_offload)
        ("a" if lay.activation_offload else "") + ("s" if lay.fsdp_offload else "") or "-",
        str(lay.micro_batch_size),
        str(lay.global_batch_size),
        f"{peak.params / GiB:.1f}",
        f"{peak.grads / GiB:.1f}",
        f"{peak.optimizer / GiB:.1f}",
        f"{peak.activations / GiB:.1f}",
        f"{peak.working / GiB:.1f}",
        f"{peak.host / GiB:.1f}",
        f"{peak.total / GiB:.1f}/{plan.gpu_memory_gb:.0f}",
        "yes" if plan.fits else "NO",
        f"{plan.time.step:.3f}",
        f"{plan.samples_per_s:.1f}",
        f"{100 * plan.mfu:.1f}%",
    )


def format_table(plans: list[Plan]) -> str:
    """Fixed-width table, one row per plan; memory columns are GiB on the busiest rank."""
    rows = [_HEADER, *(_row(p) for p in plans)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def to_json(plans: list[Plan]) -> str:
    """One JSON line: the list of ``Plan.to_dict()``."""
    return json.dumps([p.to_dict() for p in plans])
