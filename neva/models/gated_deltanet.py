"""Qwen3.5's linear-attention layer (Gated DeltaNet), its per-layer decoding state, and packed rows as samples.

The layer (transformers' ``Qwen3_5GatedDeltaNet``; its fused ``in_proj_qkv`` and ``conv1d`` held here as q, k and v
parts, ``neva.checkpoint.hf_linear_attention``, so that tensor parallelism shards each by heads): ``in_proj_q/k/v``
→ a causal depthwise convolution of ``conv_kernel_dim`` taps and SiLU over each channel → the gated delta rule
(``neva.models.delta_rule``) with ``beta = sigmoid(in_proj_b x)`` and ``g = -exp(A_log) softplus(in_proj_a x +
dt_bias)`` → per head RMSNorm gated by ``silu(in_proj_z x)`` → ``out_proj``. It reads no positions: order is the
recurrence.

Packed rows restart the convolution and the state at every sample (``neva.models.packed_rows``); a row holding one
run (unpacked) is used as it is. Under context parallelism the convolution's inputs and the state pass from chunk
to chunk of a row in order (``neva.models.recurrent_shard``).

Decoding (``RecurrentCache``): the last ``conv_kernel_dim - 1`` convolution inputs and the state of each row's last
run (a left-padded prompt's real tokens) after the prompt; each new token continues them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.config import LLMConfig
from neva.models.delta_rule import delta_rule_step, gated_delta_rule
from neva.models.layers import fp32_rms_norm
from neva.models.packed_rows import PackedRows, causal_conv, causal_conv_last
from neva.models.recurrent_shard import RecurrentShard
from neva.models.token_inputs import NO_TOKEN_INPUTS, TokenInputs, at_rows, project


@dataclass
class RecurrentCache:
    """One linear-attention layer's decoding state: ``conv`` ``[B, conv_dim, K - 1]`` (the last convolution inputs),
    ``state`` ``[B, Hv, dk, dv]`` fp32; ``length`` tokens seen (as ``KVCache.length``)."""

    conv: torch.Tensor
    state: torch.Tensor
    length: int = 0


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's channels, scaled, times ``silu(gate)`` (HF ``Qwen3_5RMSNormGated``; weight from 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if type(gate) is torch.Tensor and gate.dtype == torch.float32:
            # plain fp32: the decoder's fused RMSNorm (a third of the composite's time forward and backward)
            fused = fp32_rms_norm(x, self.weight, self.eps)
            if fused is not None:
                return fused * F.silu(gate)
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

    def forward(
        self,
        x,
        cos=None,
        sin=None,
        attn=None,
        cache: RecurrentCache | None = None,
        rows=None,
        token_inputs: TokenInputs = NO_TOKEN_INPUTS,
    ) -> torch.Tensor:
        """``token_inputs``: the forward's per-token inputs, for the projections (``neva.models.token_inputs``)."""
        b, s, _ = x.shape
        packed = None if attn is None else attn.recurrent
        ti = token_inputs
        if isinstance(packed, RecurrentShard):
            core = self._mix_sharded(x, packed, ti)
        elif cache is not None and cache.length:
            core = self._continue(x, cache, ti)
        else:
            core = self._mix(x, packed, cache, ti)
            if cache is not None:
                cache.length = s
        z = project(self.in_proj_z, x, ti).view(b, s, -1, self.value_head_dim)
        out = self.norm(core, z).reshape(b, s, -1)
        return project(self.out_proj, at_rows(out, rows), ti.at(rows))

    def _gates(self, x: torch.Tensor, ti: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
        beta = project(self.in_proj_b, x, ti).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(project(self.in_proj_a, x, ti).float() + self.dt_bias)
        return g, beta

    def _qkv(self, x: torch.Tensor, ti: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution's inputs ``[N, L, C]`` (q, k, v channels; under tensor parallelism this rank's) and its
        filters ``[C, 1, K]``."""
        projections = (self.in_proj_q, self.in_proj_k, self.in_proj_v)
        qkv = torch.cat([project(layer, x, ti) for layer in projections], dim=-1)
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

    def _mix(
        self, x: torch.Tensor, packed: PackedRows | None, cache: RecurrentCache | None, ti: TokenInputs
    ) -> torch.Tensor:
        """Rows from zero state (each packed sample alone): the rule's outputs ``[B, S, Hv, dv]``; fills ``cache``."""
        inputs, filters = self._qkv(x, ti)  # [B, S, C]
        qkv, g, beta = inputs, *self._gates(x, ti)
        if packed is not None:  # every sample after K - 1 zeros, each on a chunk boundary
            qkv, g, beta = (packed.split(t) for t in (qkv, g, beta))
        # SiLU on [B, W, C] in memory: on the transposed view its backward takes a strided path (twice the time)
        mixed = F.silu(causal_conv_last(qkv, filters).contiguous())
        q, k, v = self._heads(mixed)
        if packed is None:
            out, state = gated_delta_rule(q, k, v, g, beta)
        else:
            out, state = gated_delta_rule(q, k, v, g, beta, resets=packed.resets)
            out = packed.join(out)
        if cache is not None:
            # the last K - 1 inputs of each row's last run (zeros before its start), and its final state (the gap
            # after it leaves the state alone)
            back = torch.arange(self.kernel - 1, 0, -1, device=x.device)
            cols = x.shape[1] - back  # [K - 1]
            first = torch.zeros(x.shape[0], dtype=torch.long, device=x.device) if packed is None else packed.last
            last = inputs[:, cols.clamp(min=0)] * (cols[None, :] >= first[:, None]).to(inputs.dtype)[:, :, None]
            cache.conv.copy_(last.transpose(1, 2))
            cache.state.copy_(state)
        return out

    def _mix_sharded(self, x: torch.Tensor, shard: RecurrentShard, ti: TokenInputs) -> torch.Tensor:
        """This rank's chunks of every row under context parallelism (``neva.models.recurrent_shard``)."""
        b, _, _ = x.shape
        n, length, back = shard.chunks, shard.length, self.kernel - 1
        qkv, filters = self._qkv(x, ti)
        qkv = qkv.transpose(1, 2)  # [B, C, n · L]
        channels = qkv.shape[1]
        chunks = qkv.view(b, channels, n, length).transpose(1, 2)  # [B, n, C, L]
        previous = shard.previous(shard.gather_chunks(chunks[..., length - back :].contiguous()))
        extended = torch.cat([previous, chunks], dim=-1).reshape(b * n, channels, back + length)
        mixed = F.silu(causal_conv(extended, filters, shard.taps)[..., back:]).transpose(1, 2)
        g, beta = (t.reshape(b * n, length, -1) for t in self._gates(x, ti))
        q, k, v = self._heads(mixed)
        lay = shard.packed
        q, k, v, g, beta = (lay.split(t) for t in (q, k, v, g, beta))
        out, end = gated_delta_rule(q, k, v, g, beta, resets=lay.resets, fresh=False)
        # the same from the identity with zero values: how the outputs and the end state depend on the start
        heads, dk = v.shape[2], k.shape[-1]
        eye = torch.eye(dk, device=x.device).expand(b * n, heads, dk, dk)
        reads, transition = gated_delta_rule(q, k, v.new_zeros(*v.shape[:3], dk), g, beta, eye, resets=lay.resets)
        starts = shard.starting_states(
            end.view(b, n, *end.shape[1:]), transition.view(b, n, *transition.shape[1:])
        ).flatten(0, 1)
        out = out + torch.einsum("rwhk,rhkv->rwhv", reads.float(), starts).to(out.dtype)
        return lay.join(out).reshape(b, n * length, heads, -1)

    def _continue(self, x: torch.Tensor, cache: RecurrentCache, ti: TokenInputs) -> torch.Tensor:
        """New tokens after the cached ones (decoding)."""
        qkv, filters = self._qkv(x, ti)
        window = torch.cat([cache.conv.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)
        mixed = F.silu(F.conv1d(window, filters, groups=window.shape[1])).transpose(1, 2)
        cache.conv.copy_(window[..., window.shape[-1] - (self.kernel - 1) :])
        g, beta = self._gates(x, ti)
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
