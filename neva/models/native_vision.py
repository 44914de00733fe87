"""Pieces the native-resolution (Qwen) vision towers share: patch normalisation, the patch embedding, 2-D rotary
positions, attention within segments (frames, windows) without masks, and the blocks.

A native tower reads a variable number of patches per image. Its input is the processor's flattened patches
``[L, C·T·P·P]`` (``neva.data.qwen_images``: the channels outer, then ``temporal_patch_size`` frames, then the
``patch_size`` × ``patch_size`` pixels) and ``grid`` ``[N, 3]`` (t, h, w in patches per image or video), the patches
of each entry in merge-block order (``spatial_merge_size``² neighbouring patches consecutive, blocks row-major, frame
after frame): HF ``Qwen2VLImageProcessor``'s order, which its merger relies on. Attention never crosses a frame
(HF's ``cu_seqlens``: one segment per frame of each entry); each segment attends through SDPA on its own rows (runs
of equal-length segments batched into one call), so no ``[L, L]`` mask is ever built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.config import VisionConfig
from neva.models.layers import ACTIVATIONS, RMSNorm

ROPE_THETA = 10000.0  # HF's vision rotary base (rope_parameters.rope_theta) of Qwen2-VL, Qwen2.5-VL and Qwen3-VL


def grid_rows(grid: torch.Tensor) -> list[tuple[int, int, int]]:
    """``grid`` ``[N, 3]`` as host integers (one device sync when it lives on a GPU; the loader's is on the CPU)."""
    return [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]


def normalize_patches(pixels: torch.Tensor, cfg: VisionConfig, dtype: torch.dtype) -> torch.Tensor:
    """uint8 patches ``[L, C·T·P·P]`` → ``(x / 255 - mean[c]) / std[c]`` in fp32 (the HF processor's rescale and
    normalise, as ``neva.models.vision.normalize_pixels`` does for CLIP), then ``dtype``; float input is taken as
    normalised already."""
    if pixels.dtype != torch.uint8:
        return pixels.to(dtype)
    x = pixels.float().div_(255.0).view(pixels.shape[0], cfg.num_channels, pixels.shape[1] // cfg.num_channels)
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32).to(x.device, non_blocking=True)
    std = torch.tensor(cfg.image_std, dtype=torch.float32).to(x.device, non_blocking=True)
    return ((x - mean[:, None]) / std[:, None]).view(pixels.shape).to(dtype)


def embed_patches(conv: nn.Conv3d, pixels: torch.Tensor) -> torch.Tensor:
    """HF's ``PatchEmbed``: a Conv3d whose kernel is its stride is one Linear over the flattened patch; as a Linear it
    also takes zero patches (a rank without images) and keeps its weight in the graph."""
    weight = conv.weight.view(conv.weight.shape[0], -1)
    return F.linear(pixels.to(weight.dtype), weight, conv.bias)


def patch_positions(rows: list[tuple[int, int, int]], merge: int, device: torch.device) -> torch.Tensor:
    """``[L, 2]`` (row, column) of every patch in the processor's merge-block order, each frame alike."""
    out = []
    for t, h, w in rows:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        pos = torch.stack([hh.reshape(blocks).transpose(1, 2).flatten(), ww.reshape(blocks).transpose(1, 2).flatten()])
        out.append(pos.T.repeat(t, 1))
    return (torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)).to(device)


def rotary_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's axial vision rotary: a quarter of the head's frequencies per axis, ``[angles(row), angles(column)]`` twice
    over the head (rotate-half layout); cos and sin ``[L, head_dim]`` in fp32."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)))
    angles = positions[..., None].float() * inv_freq.to(positions.device)  # [L, 2, head_dim / 4]
    angles = angles.flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary in fp32 (as HF's ``apply_rotary_pos_emb_vision``), back to ``x``'s dtype; x ``[L, H, D]``."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def frame_lengths(rows: list[tuple[int, int, int]]) -> list[int]:
    """Segment lengths of whole-frame attention (HF ``cu_seqlens``): ``h·w`` patches, ``t`` times per entry."""
    return [h * w for t, h, w in rows for _ in range(t)]


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of ``lengths`` rows; q/k/v and the result ``[L, H, D]``.

    Each run of equal-length segments is one batched SDPA call; nothing outside a segment is computed."""
    if not lengths:  # no patch: the values themselves (zero rows) keep the projections in the graph
        return v
    runs: list[tuple[int, int]] = []  # (length, count)
    for n in lengths:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    sizes = [n * count for n, count in runs]
    outs = []
    for (n, count), qi, ki, vi in zip(runs, q.split(sizes), k.split(sizes), v.split(sizes)):
        qi, ki, vi = (t.reshape(count, n, *t.shape[1:]).transpose(1, 2) for t in (qi, ki, vi))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(1, 2).reshape(count * n, *q.shape[1:]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class NativeAttention(nn.Module):
    """Fused biased ``qkv`` and output ``o_proj`` (HF ``qkv`` / ``proj``), 2-D rotary on q and k."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        qkv = self.qkv(x)
        # Heads from the projected width: zero patches (a rank without images) still have a shape to view.
        q, k, v = qkv.view(x.shape[0], 3, qkv.shape[-1] // (3 * self.head_dim), self.head_dim).unbind(1)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        return self.o_proj(attend_segments(q, k, v, lengths).flatten(1))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) · up(x))``: biased as Qwen2.5-VL's SwiGLU, bias-free as GLM-4.1V's and Pixtral's."""

    def __init__(self, cfg: VisionConfig, bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``layer``: LayerNorm; ``rms``: RMSNorm (HF ``Qwen2RMSNorm``'s order: normalise in fp32, cast, scale)."""
    return nn.LayerNorm(dim, eps=eps) if kind == "layer" else RMSNorm(dim, eps=eps)


class NativeBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, cfg: VisionConfig, norm: str, mlp: type[nn.Module]) -> None:
        super().__init__()
        self.norm1 = make_norm(norm, cfg.hidden_size, cfg.layer_norm_eps)
        self.attn = NativeAttention(cfg)
        self.norm2 = make_norm(norm, cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = mlp(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


def empty_patches(cfg: VisionConfig, device: torch.device) -> torch.Tensor:
    """A native tower's input holding no image: ``[0, C·T·P·P]`` uint8 (its grid: ``zeros(0, 3)``)."""
    return torch.zeros(0, cfg.patch_dim, dtype=torch.uint8, device=device)


def init_native_weights(tower: nn.Module) -> None:
    """Linear layers and the patch embedding normal(0.02) with zero biases, norms reset (HF ``_init_weights``)."""
    for module in tower.modules():
        if isinstance(module, (nn.Linear, nn.Conv3d)):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            module.reset_parameters()
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
