"""Rotary position embeddings in the half-split layout that HF Llama checkpoints use.

HF's conversion script permutes Meta's interleaved q/k rows into this layout, so HF weights need no permutation here.
"""

from __future__ import annotations

import math

import torch

from neva.models.config import LLMConfig


def rope_inv_freq(cfg: LLMConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` with optional ``linear`` or ``llama3`` scaling (HF formulas)."""
    dim = cfg.rotary_dim
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


def mrope_axes(section: list[int], interleaved: bool, device: torch.device | None = None) -> torch.Tensor:
    """The position axis (0 = t, 1 = h, 2 = w) driving each of the ``sum(section)`` rotary frequencies.

    Qwen2-VL / Qwen2.5-VL: consecutive blocks of ``section[0]`` t, ``section[1]`` h and ``section[2]`` w frequencies.
    Qwen3-VL (``interleaved``): h at frequencies 1, 4, 7, ... (``section[1]`` of them), w at 2, 5, 8, ...
    (``section[2]``), t at every other one.
    """
    t, h, w = section
    j = torch.arange(t + h + w, device=device)
    # From the index alone (no host list copied to the device: no sync in the forward).
    if not interleaved:
        return (j >= t).long() + (j >= t + h).long()
    return torch.where((j % 3 == 1) & (j < 3 * h), 1, torch.where((j % 3 == 2) & (j < 3 * w), 2, 0))


def rope_cos_sin(
    inv_freq: torch.Tensor,
    position_ids: torch.Tensor,
    dtype: torch.dtype,
    mrope_section: list[int] | None = None,
    mrope_interleaved: bool = False,
):
    """``cos, sin`` of shape ``[B, 1, S, head_dim]`` for per-token positions ``[P, B, S]`` (packed rows restart at 0).

    ``P`` is the number of position axes: 1 for text and LLaVA's flattened image features. A decoder with
    ``mrope_section`` (M-RoPE) also takes ``P = 3`` (t, h, w): each frequency's angle is that of its axis
    (``mrope_axes``). One axis given to such a decoder means the three axes are equal (text, and every decode step,
    whose position is the same on all three): then every frequency's axis holds the same position and the M-RoPE
    angles are the one-axis ones, so that path computes them.
    """
    axes = position_ids.shape[0]
    if axes == 3 and mrope_section is not None:
        freqs = position_ids[..., None].float() * inv_freq.float()  # [3, B, S, head_dim / 2]
        which = mrope_axes(mrope_section, mrope_interleaved, freqs.device)
        freqs = freqs.gather(0, which.expand(1, *freqs.shape[1:]))[0]
    elif axes == 1:
        freqs = position_ids[0, ..., None].float() * inv_freq.float()
    else:
        rule = "one-axis RoPE" if mrope_section is None else "M-RoPE (1 or 3 axes)"
        raise ValueError(f"{axes} position axes given to a decoder with {rule}")
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
