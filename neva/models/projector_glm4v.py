"""GLM-4.1V's merger as a projector (``glm4v_merger``; HF ``Glm4vVisionModel.downsample`` and ``.merger``).

Each merge block of ``spatial_merge_size``² consecutive patches (the processor's order) goes through HF's Conv2d
whose kernel is its stride, run here as the Linear over the flattened ``[C, merge, merge]`` block it is, to the
decoder's width; then a Linear ``proj``, a LayerNorm (eps 1e-5, HF's default), exact GELU and a SwiGLU
(``gate_proj`` / ``up_proj`` ``intermediate_size`` wide, ``down_proj`` back; the tower's SiLU). Biases as
``ProjectorConfig.bias`` (HF: none but the Conv2d's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.config import ProjectorConfig
from neva.models.features import VisualFeatures


class BlockConv(nn.Conv2d):
    """HF's downsampling Conv2d (kernel = stride = merge), weight ``[out, C, merge, merge]`` as HF stores it, applied
    to merge blocks already flattened channels-outer (``[blocks, C · merge²]``) as the Linear it is."""

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        return F.linear(blocks, self.weight.view(self.weight.shape[0], -1), self.bias)


class Glm4vMerger(nn.Module):
    """``[L, input_size]`` patches → ``[L / merge², output_size]`` tokens (``VisualFeatures`` in and out)."""

    def __init__(self, cfg: ProjectorConfig) -> None:
        super().__init__()
        m, width, inner = cfg.spatial_merge_size, cfg.output_size, cfg.intermediate_size
        self.downsample = BlockConv(cfg.input_size, width, m, m)
        self.proj = nn.Linear(width, width, bias=cfg.bias)
        self.norm = nn.LayerNorm(width)
        self.gate_proj = nn.Linear(width, inner, bias=cfg.bias)
        self.up_proj = nn.Linear(width, inner, bias=cfg.bias)
        self.down_proj = nn.Linear(inner, width, bias=cfg.bias)
        self.unit = m * m

    def forward(self, features: VisualFeatures) -> VisualFeatures:
        x = features.main
        # [blocks, merge², C] → [blocks, C · merge²]: the Conv2d's input layout (channels outer, then row, column)
        blocks = x.reshape(-1, self.unit, x.shape[-1]).transpose(1, 2).reshape(-1, x.shape[-1] * self.unit)
        x = F.gelu(self.norm(self.proj(self.downsample(blocks))))
        return VisualFeatures(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
