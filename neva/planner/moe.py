"""MoE facts of a plan: total vs active parameters, expert memory per rank under expert parallelism, all-to-all
volume per step (``Plan.extra["moe"]``).

Rules (training's own): a token runs k of the E experts of each layer, so active parameters count ``k / E`` of the
stacked expert tensors and everything else whole (the router included); under EP a rank holds ``E / ep`` experts per
layer (``neva.parallel.expert_parallel``), FSDP2-sharded over the ``dp · cp / ep`` replicas when there are several
(expert groups are drawn from dp × cp). The dispatch sends each of a rank's tokens' hidden state to its k experts and
the result back, forward and again in backward (the all-to-all's gradient): ``4 k H`` elements per token per MoE layer
cross the all-to-all, of which the share ``(ep - 1) / ep`` leaves the rank when destinations are uniform (the aux
loss's aim). Under context parallelism a rank holds ``1 / cp`` of each row's tokens.
"""

from __future__ import annotations

from neva.models.config import NevaConfig
from neva.parallel.layout import Layout
from neva.planner.params import ParamInfo, is_expert, local_numel, on_stage


def dispatch_bytes(precision: str) -> int:
    """Bytes of one dispatched hidden-state element: the ffn norm's output, bf16 under O2 / half, fp32 otherwise
    (autocast's norm keeps the residual stream's fp32)."""
    return 2 if precision in ("o2", "half") else 4


def moe_facts(
    cfg: NevaConfig, infos: list[ParamInfo], layout: Layout, layers: list[list[int]], seq: int, act_bytes: int
) -> dict | None:
    """The plan's MoE facts for a sample of ``seq`` tokens, or None for a dense model."""
    llm = cfg.llm
    if not llm.is_moe:
        return None
    share = llm.moe_router_topk / llm.num_moe_experts
    total = sum(p.numel for p in infos)
    active = sum(p.numel * (share if is_expert(p) else 1) for p in infos)
    experts_here = max(
        sum(local_numel(p, layout) for p in infos if is_expert(p) and on_stage(p, s, layers)) for s in range(layout.pp)
    )
    tokens = seq / layout.cp * layout.micro_batch_size * layout.grad_accum  # per rank and step
    moe_layers = max(sum(llm.is_moe_layer(i) for i in stage) for stage in layers)  # Llama 4 interleaves dense ones
    volume = 4 * llm.moe_router_topk * llm.hidden_size * tokens * moe_layers * act_bytes
    return {
        "total_params": total,
        "active_params": int(active),
        "expert_params_per_rank": experts_here,
        "all_to_all_bytes_per_step": volume * (layout.ep - 1) / layout.ep,
    }
