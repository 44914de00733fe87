"""Qwen2-VL and Qwen2.5-VL vision towers at native resolution (HF ``Qwen2VisionTransformerPretrainedModel`` /
``Qwen2_5_VisionTransformerPretrainedModel`` without their merger, which is the projector here:
``neva.models.projector_merger``). The two are one class; what differs is configuration (``_KINDS``):

* Qwen2-VL: LayerNorm blocks, fc1/fc2 quick-GELU MLP, every block attends within each frame.
* Qwen2.5-VL: RMSNorm blocks, biased SwiGLU MLP, and window attention: the blocks outside ``fullatt_block_indexes``
  attend within windows of ``window_size // merge // patch`` merge units per side. HF reorders the sequence once
  so that each window is contiguous (whole merge units move, so each frame stays contiguous too) and undoes the
  order after its merger; here the order is undone before returning, per patch, which is the same thing because the
  merger acts on each merge unit alone.
"""

from __future__ import annotations

import torch
from torch import nn

from neva.models.config import VisionConfig
from neva.models.features import VisualFeatures
from neva.models.native_vision import (
    GatedMLP,
    NativeBlock,
    embed_patches,
    empty_patches,
    frame_lengths,
    grid_rows,
    init_native_weights,
    normalize_patches,
    patch_positions,
    rotary_tables,
)
from neva.models.vision import VisionMLP  # fc1, activation, fc2: CLIP's MLP is Qwen2-VL's and Qwen3-VL's

# Per tower kind: block norm, MLP, whether some blocks attend within windows.
_KINDS = {
    "qwen2_vl": dict(norm="layer", mlp=VisionMLP, windows=False, patch_bias=False),
    "qwen2_5_vl": dict(norm="rms", mlp=GatedMLP, windows=True, patch_bias=False),
    "qwen3_vl": dict(norm="layer", mlp=VisionMLP, windows=False, patch_bias=True),
}


def window_order(rows: list[tuple[int, int, int]], merge: int, units: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merge units of every frame tiled into ``units`` × ``units`` windows (the last row
    and column of windows cut short), windows row-major, units row-major inside each.

    Returns the merge-unit permutation (position i of the windowed sequence holds unit ``order[i]`` of the
    processor's sequence) and each window's length in patches."""
    order, lengths, offset = [], [], 0
    for t, h, w in rows:
        uh, uw = h // merge, w // merge
        index = torch.arange(t * uh * uw).view(t, uh, uw) + offset
        for f in range(t):
            for r in range(0, uh, units):
                for c in range(0, uw, units):
                    window = index[f, r : r + units, c : c + units].flatten()
                    order.append(window)
                    lengths.append(window.numel() * merge * merge)
        offset += t * uh * uw
    return (torch.cat(order) if order else torch.zeros(0, dtype=torch.long)), lengths


def _unpermute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Rows of the windowed order back to the processor's: row ``perm[i]`` of the result is row i of ``x``."""
    return torch.empty_like(x).index_copy(0, perm, x)


class Qwen2Tower(nn.Module):
    """Qwen2-VL / Qwen2.5-VL vision transformer behind the native tower interface (``features(pixels, grid)``,
    ``empty_input``, ``init_weights``; attributes ``cfg``, ``patch_embed``, ``layers``)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kind = _KINDS[cfg.kind]
        self.windows = kind["windows"]
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # A Conv3d for HF's weight shape [hidden, C, T, P, P]; it runs as the Linear it is (embed_patches).
        self.patch_embed = nn.Conv3d(cfg.num_channels, cfg.hidden_size, kernel, kernel, bias=kind["patch_bias"])
        self.layers = nn.ModuleDict(
            {str(i): NativeBlock(cfg, kind["norm"], kind["mlp"]) for i in range(cfg.num_layers)}
        )

    def embed(self, pixels: torch.Tensor, rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patch embeddings ``[L, hidden]`` (Qwen3-VL adds its learned positions)."""
        return embed_patches(self.patch_embed, normalize_patches(pixels, self.cfg, self.patch_embed.weight.dtype))

    def features(self, pixels: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        """Per-patch tower output in the processor's order, what HF's merger receives.

        Args:
            pixels: ``[L, C·T·P·P]`` uint8 patches (normalised here with the config's mean/std in fp32) or already
                normalised floats.
            grid: ``[N, 3]`` long, (t, h, w) in patches per image or video; ``L = Σ t·h·w``.

        Returns:
            ``VisualFeatures``: ``main`` ``[L, hidden]``; ``deepstack`` the outputs of the blocks in
            ``deepstack_visual_indexes`` (``[L, hidden]`` each, in that order; empty for Qwen2-VL / Qwen2.5-VL).
        """
        cfg = self.cfg
        rows = grid_rows(grid)
        patches = sum(t * h * w for t, h, w in rows)
        if pixels.shape != (patches, cfg.patch_dim):
            raise ValueError(
                f"pixels {tuple(pixels.shape)} do not hold the grid's {patches} patches of {cfg.patch_dim}"
            )
        x = self.embed(pixels, rows)
        rope = rotary_tables(patch_positions(rows, cfg.spatial_merge_size, x.device), cfg.hidden_size // cfg.num_heads)
        frames = frame_lengths(rows)
        windows, perm = frames, None
        if self.windows:
            units = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
            order, windows = window_order(rows, cfg.spatial_merge_size, units)
            unit = cfg.spatial_merge_size**2
            perm = (order[:, None] * unit + torch.arange(unit)).flatten().to(x.device)
            x = x[perm]
            rope = (rope[0][perm], rope[1][perm])
        deepstack = []
        for i in range(cfg.num_layers):
            x = self.layers[str(i)](x, rope, frames if i in cfg.fullatt_block_indexes else windows)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(x)
        if perm is not None:  # back to the processor's order
            x, deepstack = _unpermute(x, perm), [_unpermute(t, perm) for t in deepstack]
        return VisualFeatures(x, deepstack)

    def empty_input(self, device: torch.device) -> torch.Tensor:
        """``[0, C·T·P·P]`` uint8: no image (its grid is ``zeros(0, 3)``); ``features`` gives zero rows and keeps every
        parameter in the graph (zero gradients), so a data-parallel rank without images runs the tower like the rest."""
        return empty_patches(self.cfg, device)

    def init_weights(self) -> None:
        init_native_weights(self)
