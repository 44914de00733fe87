"""What a plan cannot know or would surprise, said under its table: a "fits" close to the device's memory (the
activation, working and overhead estimates are not exact: docs/PLANNER.md), why FSDP2's gradients are unsharded while
micro-batches accumulate (not DeepSpeed's ZeRO-2), and packed rows (planned as the mean sample's rows; a micro-batch
of samples as long as the rows can hold far more tokens)."""

from __future__ import annotations

from neva.config import TrainConfig
from neva.planner.plan import GiB, Plan

# Within this share of the device's memory a plan's "fits" is uncertain (docs/PLANNER.md, "Limits").
UNCERTAIN_MARGIN = 0.10


def caveat_lines(cfg: TrainConfig, plans: list[Plan]) -> list[str]:
    """``#`` lines under the plan table: each close call, and the packed-row worst case."""
    lines = []
    for plan in plans:
        total, limit = plan.peak.total / GiB, plan.gpu_memory_gb
        if abs(limit - total) <= UNCERTAIN_MARGIN * limit:
            verdict = "fits" if plan.fits else "does not fit"
            lines.append(
                f"# {verdict} at {total:.1f} of {limit:g} GiB (tp {plan.deployment.layout.tp}, pp "
                f"{plan.deployment.layout.pp}, dp {plan.deployment.layout.dp}): within {UNCERTAIN_MARGIN:.0%} of the "
                "device, inside the estimates' uncertainty (activations, working buffers, overhead; docs/PLANNER.md): "
                "rehearse it on one rank (plan.rehearse=true) or keep more margin"
            )
    for plan in plans[:1]:
        dep = plan.deployment
        if dep.fsdp and dep.layout.grad_accum > 1:
            lines.append(
                f"# grads {plan.peak.grads / GiB:.1f} GiB: with {dep.layout.grad_accum} micro-batches per step, FSDP2 "
                "accumulates the unsharded fp32 gradients of the stage's trained parameters (gradient sync only on the "
                "step's last micro-batch, one reduce-scatter per step); DeepSpeed's ZeRO-2 reduce-scatters every "
                "micro-batch into shards instead (less memory, that many times the traffic). Fewer accumulation steps "
                "(a larger model.micro_batch_size) shrink it"
            )
    packed = plans[0].extra.get("packing") if plans else None
    if packed is not None:
        plan = plans[0]
        mbs = plan.deployment.layout.micro_batch_size
        activ = plan.peak.activations / GiB
        worst = packed["row_limit"] * mbs
        planned = packed["rows"] * packed["row_tokens"]
        lines.append(
            f"# model.data.packing: planned as {mbs} samples of the mean {packed['mean_sample']} tokens packed into "
            f"{packed['rows']} row(s) of {packed['row_tokens']} (rows up to {packed['row_limit']}), {planned} tokens "
            f"per micro-batch ({activ:.1f} GiB of activations); {mbs} samples as long as a row would be {worst} "
            f"tokens, {worst / planned:.1f}x: plan your data's mean with plan.text_tokens=N, plan.image_tokens=data"
        )
    return lines
