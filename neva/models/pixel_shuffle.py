"""InternVL's pixel shuffle (HF ``InternVLModel.pixel_shuffle`` at ``downsample_ratio`` 0.5): each 2×2 block of the
square patch grid becomes one token, in row-major order.

``[N, g², C]`` → ``[N, (g/2)², 4C]``: token ``t = i · g/2 + j`` is the block of row pair ``i`` and column pair ``j``,
its features ``[x[2i, 2j], x[2i, 2j+1], x[2i+1, 2j], x[2i+1, 2j+1]]`` — NeMo's ``mlp_downsample`` merge with the
other token order (``neva.models.projector.Downsample2x2``: column pairs outer), so the two are separate projector
types. HF's two views and permutes reduce to this one reshape; an odd grid is refused by the config
(``ProjectorConfig.num_tokens``), as HF's views fail on it.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class PixelShuffle2x2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tokens, c = x.shape
        g = math.isqrt(tokens)
        if g * g != tokens or g % 2:
            raise ValueError(f"pixel shuffle needs an even square patch grid, got {tokens} tokens per image")
        half = g // 2
        blocks = x.view(n, half, 2, half, 2, c).permute(0, 1, 3, 2, 4, 5)  # (n, i, j, di, dj, c)
        return blocks.reshape(n, half * half, 4 * c)
