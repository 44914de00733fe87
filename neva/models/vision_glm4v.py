"""GLM-4.1V's vision tower at native resolution (HF ``Glm4vVisionModel`` up to its ``post_layernorm``; the
downsample and merger after it are the projector, ``neva.models.projector_glm4v``).

Per image the processor's flattened patches (``neva.data.qwen_images``, merge-block order) go through a biased
patch embedding (HF's Conv3d, run as the Linear it is), an RMSNorm, then the learned ``num_position_embeddings``
square table resampled to the image's own patch grid and added: HF samples it with ``grid_sample`` (bicubic,
``align_corners`` False, border padding) at each patch's centre ``((w + 0.5) / W, (h + 0.5) / H)`` in fp32, so here
too. The blocks are pre-RMSNorm: fused ``qkv`` (biased where ``qkv_bias``: HF ``attention_bias``), Qwen's 2-D
rotary, attention within each image (HF ``cu_seqlens``), a bias-free ``proj``; a bias-free SwiGLU MLP whose width is
``intermediate_size`` (HF builds it ``out_hidden_size`` wide, the decoder's width). A final RMSNorm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.config import VisionConfig
from neva.models.features import VisualFeatures
from neva.models.layers import RMSNorm
from neva.models.native_vision import (
    GatedMLP,
    attend_segments,
    embed_patches,
    empty_patches,
    frame_lengths,
    grid_rows,
    init_native_weights,
    normalize_patches,
    patch_positions,
    rotary_tables,
)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary in fp32 (HF ``apply_rotary_pos_emb_vision``), back to ``x``'s dtype; x ``[L, H, D]``."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Glm4vAttention(nn.Module):
    """``qkv`` (biased where ``cfg.qkv_bias``), 2-D rotary on q and k, attention within segments, bias-free
    ``o_proj``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        qkv = self.qkv(x)
        q, k, v = qkv.view(x.shape[0], 3, qkv.shape[-1] // (3 * self.head_dim), self.head_dim).unbind(1)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        return self.o_proj(attend_segments(q, k, v, lengths).flatten(1))


class Glm4vBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attn = Glm4vAttention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = GatedMLP(cfg, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


def sample_positions(table: torch.Tensor, rows: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """The square position table ``[N, hidden]`` resampled at every patch (``[L, hidden]``, fp32): bicubic
    ``grid_sample`` at each patch's centre of its item's grid, in the processor's merge-block order."""
    side = math.isqrt(table.shape[0])
    image = table.float().view(side, side, -1).permute(2, 0, 1)[None]
    pos = patch_positions(rows, merge, table.device).float()
    sizes = torch.tensor([(h, w) for t, h, w in rows for _ in range(t * h * w)], dtype=torch.float32)
    sizes = sizes.reshape(-1, 2).to(table.device)
    coords = (pos + 0.5) / sizes * 2 - 1  # (row, column) in [-1, 1]
    grid = coords.flip(-1)[None, :, None]  # grid_sample takes (x, y) = (column, row)
    out = F.grid_sample(image, grid, mode="bicubic", align_corners=False, padding_mode="border")
    return out[0, :, :, 0].T


class Glm4vTower(nn.Module):
    """GLM-4.1V's vision transformer behind the native tower interface (``features(pixels, grid)``,
    ``empty_input``, ``init_weights``; attributes ``cfg``, ``patch_embed``, ``layers``)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Conv3d(cfg.num_channels, cfg.hidden_size, kernel, kernel)
        self.post_conv_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Glm4vBlock(cfg) for i in range(cfg.num_layers)})
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def features(self, pixels: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        """Per-patch output after the post-RMSNorm ``[L, hidden]`` in the processor's order (what HF's downsample
        receives); ``pixels`` ``[L, C·T·P·P]`` uint8 (normalised here) or normalised floats, ``grid`` ``[N, 3]``."""
        cfg = self.cfg
        rows = grid_rows(grid)
        patches = sum(t * h * w for t, h, w in rows)
        if pixels.shape != (patches, cfg.patch_dim):
            raise ValueError(
                f"pixels {tuple(pixels.shape)} do not hold the grid's {patches} patches of {cfg.patch_dim}"
            )
        x = self.post_conv_norm(
            embed_patches(self.patch_embed, normalize_patches(pixels, cfg, self.patch_embed.weight.dtype))
        )
        if patches:
            x = x + sample_positions(self.pos_embed.weight, rows, cfg.spatial_merge_size).to(x.dtype)
        else:  # no image: the table stays in the graph (zero gradients) as on the ranks that have one
            x = x + 0 * self.pos_embed.weight[:1]
        rope = rotary_tables(patch_positions(rows, cfg.spatial_merge_size, x.device), cfg.hidden_size // cfg.num_heads)
        frames = frame_lengths(rows)
        for i in range(cfg.num_layers):
            x = self.layers[str(i)](x, rope, frames)
        return VisualFeatures(self.post_norm(x))

    def empty_input(self, device: torch.device) -> torch.Tensor:
        return empty_patches(self.cfg, device)

    def init_weights(self) -> None:
        init_native_weights(self)
