"""Video: frames through the image tower, pooled per frame, laid out in the decoder's sequence — one rule for data and model.

A video of ``F`` sampled frames is ``F`` tower inputs. Each frame's ``t × t`` feature grid (the tower's patch grid) is
pooled with a ``spatial_pool_stride`` window (LLaVA-NeXT-Video / transformers' ``LlavaNextVideoPooler``: 2×2 average,
the window never padded, so an odd side floors), then projected; the frames' tokens follow each other in time order.
``video_token_count`` is the number of decoder positions one video takes: the dataset expands a ``<video>`` placeholder
to that many video tokens before the tower runs (packing, grouping and truncation see real lengths) and the model
fills exactly those positions, so the two cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

POOL_MODES = ("average", "max")


@dataclass
class VideoConfig:
    """The model side of video (transformers' ``spatial_pool_stride`` / ``spatial_pool_mode``)."""

    spatial_pool_stride: int = 2
    spatial_pool_mode: str = "average"

    def __post_init__(self) -> None:
        if self.spatial_pool_mode not in POOL_MODES:
            raise ValueError(f"spatial_pool_mode must be one of {POOL_MODES}, got {self.spatial_pool_mode!r}")
        if self.spatial_pool_stride < 1:
            raise ValueError(f"spatial_pool_stride must be >= 1, got {self.spatial_pool_stride}")

    def frame_tokens(self, grid: int, image_tokens: int | None = None) -> int:
        """Tokens of one frame whose feature grid is ``grid × grid`` (a pooling window that does not fit is dropped).

        Stride 1 pools nothing (NeMo's Video-NeVA): a frame takes what an image takes, ``image_tokens`` when given
        (a class token kept, ``mlp_downsample``'s merge), else ``grid²``."""
        if self.spatial_pool_stride == 1:
            return grid * grid if image_tokens is None else image_tokens
        side = grid // self.spatial_pool_stride
        if side < 1:
            raise ValueError(f"spatial_pool_stride {self.spatial_pool_stride} is larger than the {grid}x{grid} grid")
        return side * side


def video_token_count(cfg: VideoConfig, grid: int, frames: int, image_tokens: int | None = None) -> int:
    """Decoder positions of one video of ``frames`` sampled frames whose per-frame feature grid is ``grid × grid``
    (``image_tokens``: an unpooled frame's count, see ``VideoConfig.frame_tokens``)."""
    if frames < 1:
        raise ValueError(f"a video needs at least one frame, got {frames}")
    return frames * cfg.frame_tokens(grid, image_tokens)


class VideoPool(nn.Module):
    """Per-frame spatial pooling of the tower's patch features (transformers' ``LlavaNextVideoPooler``, average or
    max; no parameters, so it changes no checkpoint). Runs between the tower and the projector, as transformers'
    ``LlavaNextVideoModel.get_video_features`` does (docs/ARCHITECTURE.md "Video" on LLaVA-NeXT's own order)."""

    def __init__(self, cfg: VideoConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, feats_FTD: torch.Tensor) -> torch.Tensor:
        """``[F, t·t, D]`` frame features → ``[F, (t // stride)², D]``, row-major over the pooled grid."""
        stride = self.cfg.spatial_pool_stride
        if stride == 1:
            return feats_FTD
        f, t, d = feats_FTD.shape
        side = math.isqrt(t)
        x = feats_FTD.view(f, side, side, d).permute(0, 3, 1, 2)
        pool = F.avg_pool2d if self.cfg.spatial_pool_mode == "average" else F.max_pool2d
        return pool(x, kernel_size=stride, stride=stride).flatten(2).transpose(1, 2)


def find_video_positions(input_ids: torch.Tensor, video_token: int) -> torch.Tensor:
    """``[M, 2]`` (row, column) of every video-token position, row-major: the order video features fill them (one
    video's frames in time order, a row's videos in position order). Reads the ids: for serving, not the step."""
    return (input_ids == video_token).nonzero()
