"""Gemma 3's projector (HF ``Gemma3MultiModalProjector``): the tower's square patch grid average-pooled to
``tokens_per_image`` tokens, RMS-normalised (Gemma's ``1 + w``), then one bias-free linear map to the decoder's width.

HF stores the map as a ``[vision, text]`` matrix it right-multiplies (``mm_input_projection_weight``); here it is an
``nn.Linear`` (``proj``, weight ``[text, vision]``, the transpose, converted on import and export), so tensor
parallelism, FSDP, O2 and LoRA's rules see the Linear they know.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.config import ProjectorConfig
from neva.models.layers import RMSNorm


class Gemma3Projector(nn.Module):
    """``[N, grid², vision]`` tower features → ``[N, tokens_per_image, text]``."""

    def __init__(self, cfg: ProjectorConfig) -> None:
        super().__init__()
        self.side = math.isqrt(cfg.tokens_per_image)
        self.norm = RMSNorm(cfg.input_size, cfg.norm_eps, offset=1.0)
        self.proj = nn.Linear(cfg.input_size, cfg.output_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, patches, width = x.shape
        grid = math.isqrt(patches)
        kernel = grid // self.side  # HF's AvgPool2d kernel and stride (the config check makes it tile to side²)
        pooled = F.avg_pool2d(x.transpose(1, 2).reshape(n, width, grid, grid), kernel, kernel)
        out = self.proj(self.norm(pooled.flatten(2).transpose(1, 2)))
        return out.to(x.dtype)

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        self.proj.reset_parameters()
