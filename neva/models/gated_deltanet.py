"""Qwen3.5's linear-attention layer (Gated DeltaNet), its per-layer decoding state, and packed rows as samples.

The layer (transformers' ``Qwen3_5GatedDeltaNet``; its fused ``in_proj_qkv`` and ``conv1d`` held here as q, k and v
parts, ``neva.checkpoint.hf_linear_attention``, so that tensor parallelism shards each by heads): ``in_proj_q/k/v``
→ a causal depthwise convolution of ``conv_kernel_dim`` taps and SiLU over each channel → the gated delta rule
(``neva.models.delta_rule``) with ``beta = sigmoid(in_proj_b x)`` and ``g = -exp(A_log) softplus(in_proj_a x +
dt_bias)`` → per head RMSNorm gated by ``silu(in_proj_z x)`` → ``out_proj``. It reads no positions: order is the
recurrence.

Packed rows (``SegmentBatch``): the convolution and the state must restart at every sample. Each run of equal
segment ids becomes a row of its own, padded at its end (convolution and rule then start from zeros, as for a
sample alone), with ``beta = g = 0`` on the padding, so that each row's state at its end is its sample's final
state; the outputs go back to their columns. A row holding one run (unpacked) is used as it is.

Decoding (``RecurrentCache``): the last ``conv_kernel_dim - 1`` convolution inputs and the state of each row's last
run (a left-padded prompt's real tokens) after the prompt; each new token continues them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.attention import segment_runs
from neva.models.config import LLMConfig
from neva.models.delta_rule import delta_rule_step, gated_delta_rule
from neva.models.token_inputs import at_rows, token_inputs_at


@dataclass
class RecurrentCache:
    """One linear-attention layer's decoding state: ``conv`` ``[B, conv_dim, K - 1]`` (the last convolution inputs),
    ``state`` ``[B, Hv, dk, dv]`` fp32; ``length`` tokens seen (as ``KVCache.length``)."""

    conv: torch.Tensor
    state: torch.Tensor
    length: int = 0


@dataclass
class SegmentBatch:
    """The runs of equal segment ids of ``[B, S]`` rows as ``[N, L]`` rows of their own (``L`` the longest run).

    ``slots`` ``[B·S]``: where each token (row-major) sits in the flattened ``[N·L]``; ``valid`` ``[N, L]``: real
    slots; ``ends`` ``[N]``: each run's length; ``last`` ``[B]``: each row's last run."""

    shape: tuple[int, int]
    runs: int
    width: int
    slots: torch.Tensor
    valid: torch.Tensor
    ends: torch.Tensor
    last: torch.Tensor

    @staticmethod
    def of(segment_ids: torch.Tensor, device: torch.device) -> SegmentBatch | None:
        """None where every row is one run (nothing to split)."""
        rows = segment_runs(segment_ids.cpu())
        if all(len(r) == 1 for r in rows):
            return None
        b, s = segment_ids.shape
        width = max(e - st for r in rows for st, e in r)
        slots, ends, last, n = [], [], [], 0
        for runs in rows:
            for st, e in runs:
                slots.extend(range(n * width, n * width + e - st))
                ends.append(e - st)
                n += 1
            last.append(n - 1)
        ends_t = torch.tensor(ends)
        valid = torch.arange(width)[None, :] < ends_t[:, None]
        return SegmentBatch(
            (b, s), n, width, torch.tensor(slots, device=device), valid.to(device), ends_t.to(device),
            torch.tensor(last, device=device),
        )  # fmt: skip

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` → ``[N, L, ...]`` (zeros on the padding)."""
        flat = x.reshape(-1, *x.shape[2:])
        out = flat.new_zeros(self.runs * self.width, *x.shape[2:])
        return out.index_copy(0, self.slots, flat).view(self.runs, self.width, *x.shape[2:])

    def join(self, y: torch.Tensor) -> torch.Tensor:
        """``[N, L, ...]`` → ``[B, S, ...]``."""
        return y.reshape(-1, *y.shape[2:]).index_select(0, self.slots).view(*self.shape, *y.shape[2:])


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's channels, scaled, times ``silu(gate)`` (HF ``Qwen3_5RMSNormGated``; weight from 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # Elementwise ops and a mean over the head's channels: a head-sharded DTensor (tensor parallelism) takes them.
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """One linear-attention token mixer; called as ``Attention`` is (``cos``/``sin`` unused)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        la = cfg.linear_attention
        self.key_head_dim, self.value_head_dim = la.key_head_dim, la.value_head_dim
        self.kernel = la.conv_kernel_dim
        self.in_proj_q = nn.Linear(cfg.hidden_size, la.key_dim, bias=False)
        self.in_proj_k = nn.Linear(cfg.hidden_size, la.key_dim, bias=False)
        self.in_proj_v = nn.Linear(cfg.hidden_size, la.value_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, la.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, la.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, la.num_value_heads, bias=False)
        # Depthwise filters as HF's nn.Conv1d(groups=channels).weight, [channels, 1, taps], per q / k / v channel.
        self.conv_q = nn.Parameter(torch.empty(la.key_dim, 1, la.conv_kernel_dim))
        self.conv_k = nn.Parameter(torch.empty(la.key_dim, 1, la.conv_kernel_dim))
        self.conv_v = nn.Parameter(torch.empty(la.value_dim, 1, la.conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.empty(la.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(la.num_value_heads))
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(la.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos=None, sin=None, attn=None, cache: RecurrentCache | None = None, rows=None) -> torch.Tensor:
        b, s, _ = x.shape
        segments = None if attn is None else attn.recurrent
        if cache is not None and cache.length:
            core = self._continue(x, cache)
        else:
            core = self._mix(x if segments is None else segments.split(x), segments, cache)
            if segments is not None:
                core = segments.join(core)
            if cache is not None:
                cache.length = s
        z = self.in_proj_z(x).view(b, s, -1, self.value_head_dim)
        out = self.norm(core, z).reshape(b, s, -1)
        with token_inputs_at(rows):
            return self.out_proj(at_rows(out, rows))

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return g, beta

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution's inputs ``[N, C, L]`` (q, k, v channels; under tensor parallelism this rank's) and its
        filters ``[C, 1, K]``."""
        qkv = torch.cat([self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x)], dim=-1).transpose(1, 2)
        return qkv, torch.cat([self.conv_q, self.conv_k, self.conv_v])

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = mixed.shape
        key_dim = self.conv_q.shape[0]
        q, k, v = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
        return (
            q.reshape(b, s, -1, self.key_head_dim),
            k.reshape(b, s, -1, self.key_head_dim),
            v.reshape(b, s, -1, self.value_head_dim),
        )

    def _mix(self, x: torch.Tensor, segments: SegmentBatch | None, cache: RecurrentCache | None) -> torch.Tensor:
        """Rows from zero state (each run alone): the rule's outputs ``[N, L, Hv, dv]``; fills ``cache``."""
        qkv, filters = self._qkv(x)
        padded = F.pad(qkv, (self.kernel - 1, 0))
        mixed = F.silu(F.conv1d(padded, filters, groups=qkv.shape[1])).transpose(1, 2)
        g, beta = self._gates(x)
        if segments is not None:  # the padding after each run leaves its state alone
            g, beta = g * segments.valid[..., None], beta * segments.valid[..., None]
        q, k, v = self._heads(mixed)
        out, state = gated_delta_rule(q, k, v, g, beta)
        if cache is not None:
            ends = torch.full((x.shape[0],), x.shape[1], device=x.device) if segments is None else segments.ends
            rows = torch.arange(x.shape[0], device=x.device) if segments is None else segments.last
            # the last K - 1 inputs of each row's last run: padded columns end .. end + K - 2
            cols = ends[rows, None] + torch.arange(self.kernel - 1, device=x.device)
            cache.conv.copy_(padded[rows[:, None], :, cols].transpose(1, 2))
            cache.state.copy_(state[rows])
        return out

    def _continue(self, x: torch.Tensor, cache: RecurrentCache) -> torch.Tensor:
        """New tokens after the cached ones (decoding)."""
        qkv, filters = self._qkv(x)
        window = torch.cat([cache.conv.to(qkv.dtype), qkv], dim=-1)
        mixed = F.silu(F.conv1d(window, filters, groups=qkv.shape[1])).transpose(1, 2)
        cache.conv.copy_(window[..., window.shape[-1] - (self.kernel - 1) :])
        g, beta = self._gates(x)
        q, k, v = self._heads(mixed)
        out, state = delta_rule_step(q, k, v, g, beta, cache.state)
        cache.state.copy_(state)
        cache.length += x.shape[1]
        return out

    def reset_parameters(self) -> None:
        """The parameters outside its Linears, as transformers initialises them."""
        for w in (self.conv_q, self.conv_k, self.conv_v):
            # nn.Conv1d's default (fan-in: its taps), as HF's fused filter gets it
            nn.init.uniform_(w, -(w.shape[-1] ** -0.5), w.shape[-1] ** -0.5)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
        self.norm.reset_parameters()


def new_recurrent_cache(cfg: LLMConfig, batch_size: int, device, dtype) -> RecurrentCache:
    la = cfg.linear_attention
    return RecurrentCache(
        torch.zeros(batch_size, la.conv_dim, la.conv_kernel_dim - 1, device=device, dtype=dtype),
        torch.zeros(batch_size, la.num_value_heads, la.key_head_dim, la.value_head_dim, device=device),
    )
