"""Group-relative policy optimisation (GRPO and its variants) on per-token log-probabilities, outside the model.

A rollout batch holds ``G`` completions of each prompt, each with a scalar reward. Everything here is a function of
the completions' token log-probs under the policy (``logp``), under the policy that sampled them (``old``, recorded
before the first of the ``num_iterations`` updates) and under the frozen reference (``ref``):

    advantage  A_i = (r_i − mean_group(r)) / (std_group(r) + 1e-4)        scale_rewards=group (Shao et al. 2024)
               A_i = (r_i − mean_group(r)) / (std_batch(r) + 1e-4)        scale_rewards=batch
               A_i =  r_i − mean_group(r)                                 scale_rewards=none (Dr. GRPO, Liu et al. 2025)
               (std: unbiased, Bessel's correction, as TRL's ``nanstd``)
    ratio      ρ_t = exp(logp_t − old_t)
    token      ℓ_t = −min(ρ_t·A, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A) + β·k3_t
               dual clip c > 1 (Ye et al. 2020, arXiv:1912.09729, "dual-clip PPO"; EasyR1's clip_ratio_dual):
               where A < 0 the policy term −min(ρ_t·A, clip(ρ_t, …)·A) is capped at −c·A, so a token the update
               makes rarer whose ratio already exceeds c adds a constant (no gradient), not a loss growing with ρ_t
    k3         k3_t = exp(ref_t − logp_t) − (ref_t − logp_t) − 1          (Schulman's low-variance KL estimator)
               × ρ_t with kl_ratio_correction (TRL's use_bias_correction_kl, DeepSeek-V3.2: the unbiased
               reverse-KL gradient off-policy; GRPO, EasyR1 and veRL leave it out, neva's default)

and the step's loss is the tokens' sum over the global batch divided by what the variant normalises by
(``LOSS_TYPES``; TRL's ``GRPOTrainer._compute_loss``, loss types of the same names):

    grpo      Σ_i (Σ_t ℓ_t / |o_i|) / N          each completion's token mean, averaged over completions
    dapo      Σ_i Σ_t ℓ_t / Σ_i |o_i|            every token weighs the same (DAPO, Yu et al. 2025)
    dr_grpo   Σ_i Σ_t ℓ_t / (N · L_max)          a constant: N completions × max new tokens (Dr. GRPO)
"""

from __future__ import annotations

import torch

EPS = 1e-4  # TRL's: added to the std before dividing

# name -> (whether each completion's tokens are weighted by 1 / its length, the step's divisor's unit)
LOSS_TYPES: dict[str, tuple[bool, str]] = {
    "grpo": (True, "completions"),
    "dapo": (False, "tokens"),
    "dr_grpo": (False, "completion_slots"),
}
SCALE_REWARDS = ("group", "batch", "none")


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased std over the non-NaN entries (TRL's ``nanstd``); NaN where fewer than two."""
    mean = x.nanmean() if dim is None else x.nanmean(dim, keepdim=True)
    n = (~x.isnan()).sum() if dim is None else (~x.isnan()).sum(dim)
    sq = (x - mean) ** 2
    var = (sq.nansum() if dim is None else sq.nansum(dim)) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), torch.full_like(var, float("nan")))


def group_advantages(rewards: torch.Tensor, group: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages ``[N]``, whether each completion's group has all-equal rewards ``[N]``) of rewards ``[N]`` laid
    out group by group (``group`` consecutive completions per prompt). A NaN reward (no reward function scored the
    completion) is left out of its group's mean and std and takes advantage 0, as in TRL."""
    grouped = rewards.float().view(-1, group)
    centred = (grouped - grouped.nanmean(1, keepdim=True)).flatten()
    group_std = _nanstd(grouped, 1).nan_to_num(0.0).repeat_interleave(group)
    flat = torch.isclose(group_std, torch.zeros_like(group_std))
    if scale == "group":
        centred = centred / (group_std + EPS)
    elif scale == "batch":
        centred = centred / (_nanstd(rewards.float()).nan_to_num(0.0) + EPS)
    return centred.nan_to_num(0.0), flat


def k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref) from the sampled tokens' log-probs (≥ 0, unbiased)."""
    d = ref - logp
    return torch.exp(d) - d - 1


def token_losses(
    logp: torch.Tensor,
    old: torch.Tensor,
    advantage: torch.Tensor,
    eps_low: float,
    eps_high: float,
    beta: float = 0.0,
    ref: torch.Tensor | None = None,
    kl_ratio_correction: bool = False,
    dual: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token k3 (zeros without a reference), whether the clip bound the token) for tensors of one
    shape: each token's log-prob under the policy, the sampling policy and the reference, and its completion's
    advantage (the k3 returned is the estimate itself, without the ratio ``kl_ratio_correction`` weights the term
    with; ``dual``: the dual clip's c, None: off). A token counts as clipped where the clipped term is the smaller one,
    as TRL counts its clip ratio, or where the dual clip caps it."""
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * advantage, clipped * advantage)
    negative = advantage < 0
    if dual is not None:
        loss = torch.where(negative, torch.minimum(loss, -dual * advantage), loss)
    kl = k3(logp, ref) if ref is not None else torch.zeros_like(logp)
    if beta:
        loss = loss + beta * (kl * ratio if kl_ratio_correction else kl)
    bound = ((ratio < 1 - eps_low) & negative) | ((ratio > 1 + eps_high) & (advantage > 0))
    if dual is not None:  # for A < 0 the capped term binds exactly where ρ_t > c (c > 1 > 1 − ε_low)
        bound = bound | ((ratio > dual) & negative)
    return loss, kl, bound
