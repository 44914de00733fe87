"""Vision→LLM projector (LLaVA ``mm_projector``; NeMo's ``mlp_downsample``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from neva.families import MERGERS, part
from neva.models.config import ProjectorConfig
from neva.models.layers import RMSNorm
from neva.models.pixel_shuffle import PixelShuffle2x2
from neva.models.projector_gemma3 import Gemma3Projector
from neva.models.projector_merger import NativeMerger


class Downsample2x2(nn.Module):
    """NeMo NeVA's ``DownSampleBlock`` (from VILA): each 2×2 block of the square patch grid becomes one token.

    ``[N, g², C]`` → ``[N, ceil(g/2)², 4C]``. An odd grid gets one zero row at the bottom and one zero column at the
    right first. Token ``t = j · ceil(g/2) + i`` is the block of row pair ``i`` and column pair ``j`` (column pairs
    outer: NeMo's order, and VILA's until its NVILA release of December 2024, whose ``mlp_downsample`` adds a final
    permute to row-major order, another model), its features ``[x[2i, 2j], x[2i, 2j+1], x[2i+1, 2j], x[2i+1, 2j+1]]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tokens, c = x.shape
        g = math.isqrt(tokens)
        if g * g != tokens:
            raise ValueError(f"mlp_downsample needs a square patch grid, got {tokens} tokens per image")
        pad = g % 2
        grid = F.pad(x.view(n, g, g, c), (0, 0, 0, pad, 0, pad))
        half = (g + pad) // 2
        blocks = grid.view(n, half, 2, half, 2, c).permute(0, 3, 1, 2, 4, 5)  # (n, j, i, di, dj, c)
        return blocks.reshape(n, half * half, 4 * c)


def build_projector(cfg: ProjectorConfig) -> nn.Module:
    """``linear``, ``identity``, ``mlp{N}x_gelu`` or ``mlp_downsample`` as an ``nn.Sequential``; a native tower's
    merger (``MERGERS``) as ``neva.models.projector_merger.NativeMerger`` (it maps ``VisualFeatures``).

    A Sequential keeps LLaVA's own key names (``0``, ``2``, ... for the Linear layers of ``mlp2x_gelu``), so the
    original LLaVA ``model.mm_projector.{i}`` keys map one to one; ``mlp_downsample`` is NeMo's / VILA's Sequential
    (``0`` the merge, ``1`` the LayerNorm over ``4 × input_size``, ``2`` and ``4`` the Linear layers), and so is
    ``mlp_pixel_shuffle`` (InternVL's ``multi_modal_projector``: ``layer_norm``, ``linear_1``, ``linear_2``).
    """
    if cfg.type in MERGERS:  # a native tower's merger: its family's own class where it names one
        own = MERGERS[cfg.type].projector
        return NativeMerger(cfg) if own is None else part(own)(cfg)
    if cfg.type == "gemma3":
        return Gemma3Projector(cfg)
    if cfg.type == "identity":
        return nn.Sequential(nn.Identity())
    if cfg.type in ("mlp_downsample", "mlp_pixel_shuffle"):  # InternVL's: its merge, then the same layers
        width = 4 * cfg.input_size
        return nn.Sequential(
            Downsample2x2() if cfg.type == "mlp_downsample" else PixelShuffle2x2(),
            nn.LayerNorm(width),
            nn.Linear(width, cfg.output_size, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(cfg.output_size, cfg.output_size, bias=cfg.bias),
        )
    layers: list[nn.Module] = [nn.Linear(cfg.input_size, cfg.output_size, bias=cfg.bias)]
    for _ in range(1, cfg.depth):
        layers += [nn.GELU(), nn.Linear(cfg.output_size, cfg.output_size, bias=cfg.bias)]
    return nn.Sequential(*layers)


def init_projector(projector: nn.Module) -> None:
    for module in projector.modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm, RMSNorm, nn.Conv2d)):
            module.reset_parameters()
