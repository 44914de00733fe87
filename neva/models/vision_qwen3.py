"""Qwen3-VL vision tower at native resolution (HF ``Qwen3VLVisionModel`` without its mergers, which are the projector
here: ``neva.models.projector_merger``).

What differs from Qwen2-VL (``neva.models.vision_qwen2``, whose class this extends): a biased patch embedding,
tanh-GELU in the fc1/fc2 MLP, and learned absolute positions: a square table of ``num_position_embeddings`` entries
resampled bilinearly (align_corners) to each image's patch grid and added to the patch embeddings, every frame of a
video alike. The outputs of the blocks in ``deepstack_visual_indexes`` come back as ``VisualFeatures.deepstack``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from neva.models.config import VisionConfig
from neva.models.native_vision import init_native_weights, patch_positions
from neva.models.vision_qwen2 import Qwen2Tower


def bilinear_taps(positions: torch.Tensor, sizes: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch, the four table entries and weights of an align-corners bilinear resample of a ``side`` × ``side``
    table to its image's grid: ``positions`` ``[L, 2]`` (row, column), ``sizes`` ``[L, 2]`` (h, w) of its grid.
    Returns indices ``[L, 4]`` into the flattened table and weights ``[L, 4]`` (row taps outer)."""
    src = positions.float() * (side - 1) / (sizes - 1).clamp(min=1)
    floor = src.floor()
    taps = (floor.long()[..., None] + torch.arange(2)).clamp(max=side - 1)  # [L, 2 axes, 2 taps]
    frac = (src - floor)[..., None]
    weights = torch.cat([1 - frac, frac], dim=-1)
    index = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).flatten(1)
    return index, (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)


class Qwen3Tower(Qwen2Tower):
    """Qwen3-VL vision transformer (``features`` returns its DeepStack features too); attribute ``pos_embed`` besides
    the Qwen2 tower's."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)

    def embed(self, pixels: torch.Tensor, rows: list[tuple[int, int, int]]) -> torch.Tensor:
        x = super().embed(pixels, rows)
        side = math.isqrt(self.cfg.num_position_embeddings)
        positions = patch_positions(rows, self.cfg.spatial_merge_size, torch.device("cpu"))
        counts = torch.tensor([t * h * w for t, h, w in rows], dtype=torch.long)
        sizes = torch.tensor([[h, w] for _, h, w in rows], dtype=torch.long).view(-1, 2).repeat_interleave(counts, 0)
        index, weights = bilinear_taps(positions, sizes, side)
        table = self.pos_embed(index.to(x.device))  # [L, 4, hidden]; zero rows keep the table in the graph
        pos = (table * weights.to(x.device, table.dtype)[..., None]).sum(1)
        return x + pos.to(x.dtype)

    def init_weights(self) -> None:
        init_native_weights(self)
