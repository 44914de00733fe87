"""Rotary position embeddings in the half-split layout that HF Llama checkpoints use.

HF's conversion script permutes Meta's interleaved q/k rows into this layout, so HF weights need no permutation here.
"""

from __future__ import annotations

import math

import torch

from neva.models.config import LLMConfig


def rope_inv_freq(cfg: LLMConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` with optional ``linear`` or ``llama3`` scaling (HF formulas)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """``cos, sin`` of shape ``[B, 1, S, head_dim]`` for per-token positions ``[P, B, S]`` (packed rows restart at 0).

    ``P`` is the number of position axes: 1 for text and LLaVA's flattened image features. Several axes (time,
    height, width) need a rule saying which rotary frequencies each axis drives, which this decoder does not have.
    """
    if position_ids.shape[0] != 1:
        raise ValueError(f"{position_ids.shape[0]} position axes given to a decoder with one-axis RoPE")
    freqs = position_ids[0, ..., None].float() * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class _Rope(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` in one allocation; backward applies the transposed rotation.

    The composite (neg, cat, two products, a sum, and their backward) made five ``[B, H, S, D]`` tensors per call
    for q and for k, each layer; here one, with the rotation as two in-place multiply-adds on the halves.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        # The gradient goes back in x's memory layout (q/k are head views of a [B, S, H*D] projection): the
        # backward of that view is then free instead of a copy.
        ctx.token_major = x.dim() == 4 and x.transpose(1, 2).is_contiguous()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        if ctx.token_major:
            grad_x = torch.mul(grad, cos, out=grad.new_empty(grad.transpose(1, 2).shape).transpose(1, 2))
        else:
            grad_x = grad * cos
        grad_x[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        grad_x[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1)
        return grad_x, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, S, D]`` by the angles whose ``cos, sin`` (``[B, 1, S, D]``) ``rope_cos_sin`` made."""
    if cos.requires_grad or sin.requires_grad:  # angles are buffers, never trained; keep autograd exact if they were
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    return _Rope.apply(x, cos, sin)
