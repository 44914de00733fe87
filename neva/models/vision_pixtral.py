"""Pixtral's vision tower (Mistral 3's; HF ``PixtralVisionModel``) at each image's own resolution.

Its input is the patch-grid tower's: flattened uint8 patches ``[L, C·P·P]`` and ``grid`` ``[N, 3]`` (1, h, w) per
image, each image's patches in merge-block order (``neva.data.pixtral_images``: 2×2 neighbouring patches consecutive,
blocks row-major), the order the merger reads. HF runs each image's patches row-major; attention within an image is
blind to the order of its rows once each carries its own (row, column) rotary, and RMSNorm, MLP and projections act
per patch, so the two orders give the same features, permuted.

What differs from the Qwen towers: q / k / v / o and the gated MLP without biases, an RMSNorm after the patch
convolution (``ln_pre``), and the rotary's frequencies: HF computes ``θ^(-2i/d)`` over the head size ``d`` and gives
the even ones to the row, the odd ones to the column (Qwen's share one set), each axis's angles then repeated over
the rotate-half pairs.
"""

from __future__ import annotations

import torch
from torch import nn

from neva.models.config import VisionConfig
from neva.models.features import VisualFeatures
from neva.models.layers import RMSNorm
from neva.models.native_vision import (
    GatedMLP,
    _rotate,
    attend_segments,
    embed_patches,
    empty_patches,
    frame_lengths,
    grid_rows,
    normalize_patches,
    patch_positions,
)

ROPE_THETA = 10000.0  # HF PixtralVisionConfig's rope_theta (Pixtral-12B's and Mistral Small 3.1's hub configs)


def pixtral_rotary(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[L, head_dim]`` (fp32) of patches at ``positions`` ``[L, 2]`` (row, column): the row's angles
    at the even frequencies, the column's at the odd ones, that half repeated (rotate-half layout)."""
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = freqs.to(positions.device)
    pos = positions.float()
    angles = torch.cat([pos[:, :1] * freqs[0::2], pos[:, 1:] * freqs[1::2]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class PixtralAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.hidden_size
        self.head_dim = width // cfg.num_heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Heads from the projected width: zero patches (a rank without images) still have a shape to view.
        q, k, v = (t.view(x.shape[0], t.shape[-1] // self.head_dim, self.head_dim) for t in (q, k, v))
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        if (
            not lengths
        ):  # no patch: the zero rows of all three keep q / k / v in the graph (zero gradients on this rank)
            return self.o_proj((q + k + v).flatten(1))
        return self.o_proj(attend_segments(q, k, v, lengths).flatten(1))


class PixtralBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (HF ``attention_norm`` / ``ffn_norm``)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = PixtralAttention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = GatedMLP(cfg, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PixtralTower(nn.Module):
    """The patch-grid tower interface (``features(pixels, grid)``, ``empty_input``, ``init_weights``; ``cfg``,
    ``patch_embed``, ``layers``) over Pixtral."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # HF's Conv2d weight [hidden, C, P, P]; it runs as the Linear it is over flattened patches (embed_patches).
        self.patch_embed = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=False)
        self.pre_norm = RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleDict({str(i): PixtralBlock(cfg) for i in range(cfg.num_layers)})

    def features(self, pixels: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        """The last block's output per patch ``[L, hidden]`` in the input's (merge-block) order.

        Args:
            pixels: ``[L, C·P·P]`` uint8 patches (normalised here in fp32) or already normalised floats.
            grid: ``[N, 3]`` long, (1, h, w) patches per image; ``L = Σ h·w``.
        """
        cfg = self.cfg
        rows = grid_rows(grid)
        patches = sum(t * h * w for t, h, w in rows)
        if pixels.shape != (patches, cfg.patch_dim):
            raise ValueError(
                f"pixels {tuple(pixels.shape)} do not hold the grid's {patches} patches of {cfg.patch_dim}"
            )
        x = self.pre_norm(
            embed_patches(self.patch_embed, normalize_patches(pixels, cfg, self.patch_embed.weight.dtype))
        )
        positions = patch_positions(rows, cfg.spatial_merge_size, x.device)
        rope = pixtral_rotary(positions, cfg.hidden_size // cfg.num_heads)
        lengths = frame_lengths(rows)  # one segment per image: attention never crosses images
        for i in range(cfg.num_layers):
            x = self.layers[str(i)](x, rope, lengths)
        return VisualFeatures(x)

    def empty_input(self, device: torch.device) -> torch.Tensor:
        """``[0, C·P·P]`` uint8: no image; ``features`` then gives zero rows with every parameter in the graph."""
        return empty_patches(self.cfg, device)

    def init_weights(self) -> None:
        """Linear layers and the patch convolution normal(0.02), norms reset (HF ``_init_weights``)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
