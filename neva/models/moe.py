"""Sparse mixture-of-experts feed-forward (Mixtral's), its routing statistics and load-balancing losses.

Routing is Mixtral's, as transformers' ``MixtralSparseMoeBlock`` computes it: router logits ``x W_r^T`` (no bias),
a softmax over all experts in fp32, the top-k probabilities, renormalised to sum to 1 over the k; every token reaches
its k experts (no capacity, no token dropping). Each expert is a SwiGLU ``w2(silu(w1 x) * w3 x)``; the experts of a
layer live in one tensor per projection (``w1``/``w3`` ``[E, I, H]``, ``w2`` ``[E, H, I]``) so that one grouped GEMM
can run them all: ``torch._grouped_mm`` on CUDA (bf16, Hopper+) and the CPU, a loop over the experts' token groups
elsewhere (same numbers).

Tokens are sorted by expert before the experts run and put back after; what happens in between is the layer's
``dispatcher`` (a plain callable, not a module): ``local_dispatch`` runs the experts here; expert parallelism
(``neva.parallel.expert_parallel``) installs one that sends each group to the rank owning its expert and back. The
model code knows nothing of it.

Load balancing. Each forward records ``RoutingStats`` per layer over the tokens that count (the forward's
``token_mask``, ``neva.models.token_inputs``: True for real tokens; image and prompt tokens count, padding does not,
as in both sources: transformers masks padding with the attention mask, Megatron-Core with its ``padding_mask``).
With, per layer l, T_l counted tokens, n_le the top-k assignments to expert e and P_le the sum of the router
probabilities of expert e over those tokens, E experts, k chosen per token and L layers:

  megatron (Megatron-Core ``switch_load_balancing_loss_func``, NeMo's; per layer, summed over layers)
      aux = sum_l  E / (k T_l^2) * sum_e n_le P_le                    (= L when perfectly balanced)
  hf (transformers ``load_balancing_loss_func``: every layer's rows concatenated, one loss)
      aux = E * sum_e (sum_l n_le / sum_l T_l) (sum_l P_le / sum_l T_l)  (= k when perfectly balanced)
  z-loss (Megatron-Core ``z_loss_func``, ST-MoE; either formula)
      z = sum_l mean_{t in T_l} logsumexp(router logits_t)^2

The objective adds ``moe_aux_loss_coeff * aux + moe_z_loss_coeff * z`` per micro-batch (``aux_objective``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.config import LLMConfig
from neva.models.layers import swiglu
from neva.models.token_inputs import NO_TOKEN_INPUTS, TokenInputs, project


@dataclass
class RoutingStats:
    """One layer's routing over one forward's counted tokens.

    ``counts`` [E] (no gradient) top-k assignments per expert; ``prob_sum`` [E] summed router probabilities;
    ``z_sum`` summed squared logsumexp of the router logits; ``tokens`` counted tokens; ``top_k_index`` [T, k] the
    chosen experts of every token (counted or not), for inspection.
    """

    counts: torch.Tensor
    prob_sum: torch.Tensor
    z_sum: torch.Tensor
    tokens: torch.Tensor
    top_k_index: torch.Tensor


class Router(nn.Module):
    """Mixtral's top-k softmax router (HF ``block_sparse_moe.gate``), or Llama 4's sigmoid of the top-k logits
    (``moe_router_score_function``; HF ``Llama4Router``: the top-k of the logits, each through a sigmoid in fp32)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_router_topk
        self.sigmoid = cfg.moe_router_score_function == "sigmoid"
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [T, H] → (logits [T, E], fp32 probabilities [T, E], fp32 top-k weights [T, k], top-k index [T, k])."""
        logits = F.linear(x, self.weight)
        if self.sigmoid:  # the load-balancing statistics read each expert's own sigmoid score
            top, index = torch.topk(logits, self.top_k, dim=-1)
            return logits, torch.sigmoid(logits.float()), torch.sigmoid(top.float()), index
        probs = torch.softmax(logits.float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        return logits, probs, weights / weights.sum(dim=-1, keepdim=True), index


def _grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs here: on CUDA in bf16 from Hopper on, on the CPU (torch's CPU kernel) for
    the weights' own dtype outside autocast (the kernel is not autocast-aware: under autocast the loop's F.linear
    computes in autocast's dtype); elsewhere the experts loop."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")


class Experts(nn.Module):
    """E SwiGLU experts in three stacked tensors; ``forward`` takes tokens already grouped by expert."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_moe_experts, cfg.hidden_size, cfg.intermediate_size
        self.w1 = nn.Parameter(torch.empty(e, i, h))
        self.w3 = nn.Parameter(torch.empty(e, i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [N, H]: rows grouped by expert, ``counts`` rows per expert of the experts this module holds (a
        parallel plan may hand it only some experts' rows and their tensors' local shards)."""
        return run_experts(self.w1, self.w3, self.w2, x, counts)


def run_experts(
    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, counts: torch.Tensor | list[int]
) -> torch.Tensor:
    """SwiGLU experts ``w1``/``w3`` [E, I, H], ``w2`` [E, H, I] on rows ``x`` [N, H] grouped by expert, ``counts``
    [E] rows each (a tensor, or host integers when a dispatcher fixes them): one grouped GEMM per projection where
    torch has one for the device (``grouped_experts``), else a loop over experts (``looped_experts``); the same
    numbers either way."""
    run = grouped_experts if _grouped_mm_supported(x, w1) else looped_experts
    return run(w1, w3, w2, x, counts)


def grouped_experts(w1, w3, w2, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
    offs = torch.cumsum(torch.as_tensor(counts, device=x.device), 0, dtype=torch.int32)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(swiglu(gate, up), w2.transpose(-2, -1), offs=offs)


def looped_experts(w1, w3, w2, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
    sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    # One unbind per tensor, not an index per expert: the backward of ``w[e]`` fills a zero tensor of the whole
    # stack per expert (E^2 work), ``unbind``'s stacks the E gradients once.
    w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
    out = []
    for e, rows in enumerate(x.split(sizes)):
        if rows.shape[0]:
            out.append(F.linear(swiglu(F.linear(rows, w1s[e]), F.linear(rows, w3s[e])), w2s[e]))
    return torch.cat(out) if out else x.new_zeros(x.shape)


# (experts, rows grouped by expert, rows per expert [E]) -> the experts' outputs in the same order.
Dispatcher = Callable[[Experts, torch.Tensor, torch.Tensor], torch.Tensor]


def local_dispatch(experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return experts(x, counts)


class SharedExpert(nn.Module):
    """A SwiGLU every token passes through beside its routed experts, optionally scaled by ``sigmoid(gate x)`` per
    token (Qwen3.5-MoE's ``shared_expert`` and ``shared_expert_gate``; Megatron-Core's ``moe_shared_expert_*``)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        width = cfg.moe_shared_expert_intermediate_size
        self.w1 = nn.Linear(cfg.hidden_size, width, bias=False)
        self.w2 = nn.Linear(width, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, width, bias=False)
        self.gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.moe_shared_expert_gate else None

    def forward(self, x: torch.Tensor, token_inputs: TokenInputs = NO_TOKEN_INPUTS) -> torch.Tensor:
        t = token_inputs
        out = project(self.w2, swiglu(project(self.w1, x, t), project(self.w3, x, t)), t)
        return out if self.gate is None else torch.sigmoid(project(self.gate, x, t)) * out


class MoEFeedForward(nn.Module):
    """Router + experts in place of the dense SwiGLU (HF ``block_sparse_moe`` / transformers 5 ``mlp``), and a shared
    expert where the config has one."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_moe_experts
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.dispatcher: Dispatcher = local_dispatch
        self.routing: RoutingStats | None = None
        self.shared_expert = SharedExpert(cfg) if cfg.moe_shared_expert_intermediate_size else None
        self.scale_input = cfg.moe_apply_probs_on_input

    def forward(self, x: torch.Tensor, token_inputs: TokenInputs = NO_TOKEN_INPUTS) -> torch.Tensor:
        """``x`` [..., H]; the forward's ``token_inputs.token_mask`` (x's leading shape, True = counts for load
        balancing; None = all count) selects the tokens of the routing statistics."""
        flat = x.reshape(-1, x.shape[-1])
        logits, probs, weights, index = self.router(flat)
        token_mask = token_inputs.token_mask
        mask = None if token_mask is None else token_mask.reshape(-1).to(probs.device)
        self.routing = routing_stats(logits, probs, index, mask, self.num_experts)
        k = index.shape[1]
        order = index.reshape(-1).argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // k
        # per-expert rows; scatter_add_ (not bincount) keeps the shape static for runs on fake tensors
        flat_index = index.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_index, torch.ones_like(flat_index)
        )
        if self.scale_input:  # Llama 4: the score scales the expert's input, in the activations' dtype (as HF)
            y = self.dispatcher(self.experts, flat[tokens] * weights.reshape(-1)[order, None].to(flat.dtype), counts)
        else:
            y = self.dispatcher(self.experts, flat[tokens], counts)
            # The k contributions of a token are added in fp32 weights' precision, then cast (as HF's index_add_).
            y = (y * weights.reshape(-1)[order, None]).to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, tokens, y)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat, token_inputs)
        return out.view(x.shape)

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.router.weight, self.experts.w1, self.experts.w3, self.experts.w2):
            nn.init.normal_(p, std=std)


def routing_stats(
    logits: torch.Tensor, probs: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None, num_experts: int
) -> RoutingStats:
    weight = torch.ones(probs.shape[0], device=probs.device) if mask is None else mask.float()
    with torch.no_grad():
        counts = torch.zeros(num_experts, device=probs.device).index_add_(
            0, index.reshape(-1), weight.repeat_interleave(index.shape[1])
        )
    z = torch.logsumexp(logits.float(), dim=-1).square()
    return RoutingStats(
        counts=counts,
        prob_sum=(probs * weight[:, None]).sum(0),
        z_sum=(z * weight).sum(),
        tokens=weight.sum().detach(),
        top_k_index=index.detach(),
    )


def load_balancing_loss(stats: list[RoutingStats], cfg: LLMConfig) -> torch.Tensor:
    """The load-balancing loss of ``cfg.moe_aux_loss_formula`` over these layers' stats (module docstring)."""
    e, k = cfg.num_moe_experts, cfg.moe_router_topk
    if cfg.moe_aux_loss_formula == "megatron":
        return sum(e / (k * s.tokens.clamp(min=1.0) ** 2) * (s.counts * s.prob_sum).sum() for s in stats)
    tokens = sum(s.tokens for s in stats).clamp(min=1.0)
    counts = sum(s.counts for s in stats) / tokens
    probs = sum(s.prob_sum for s in stats) / tokens
    return e * (counts * probs).sum()


def z_loss(stats: list[RoutingStats]) -> torch.Tensor:
    return sum(s.z_sum / s.tokens.clamp(min=1.0) for s in stats)


def aux_objective(stats: list[RoutingStats], cfg: LLMConfig) -> torch.Tensor | None:
    """``moe_aux_loss_coeff * aux + moe_z_loss_coeff * z`` for one micro-batch, or None when neither is on."""
    if not stats:
        return None
    terms = []
    if cfg.moe_aux_loss_coeff:
        terms.append(cfg.moe_aux_loss_coeff * load_balancing_loss(stats, cfg))
    if cfg.moe_z_loss_coeff:
        terms.append(cfg.moe_z_loss_coeff * z_loss(stats))
    return sum(terms) if terms else None


def moe_layers(modules: list[nn.Module]) -> list[MoEFeedForward]:
    """Every MoE feed-forward of these modules, in layer order."""
    return [m for module in modules for m in module.modules() if isinstance(m, MoEFeedForward)]
