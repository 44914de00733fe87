"""Video: frames through the image tower, pooled per frame, laid out in the decoder's sequence — one rule for data and model.

A video of ``F`` sampled frames is ``F`` tower inputs. Each frame's ``t × t`` feature grid (the tower's patch grid) is
pooled with a ``spatial_pool_stride`` window (LLaVA-NeXT-Video / transformers' ``LlavaNextVideoPooler``: 2×2 average,
the window never padded, so an odd side floors), then projected; the frames' tokens follow each other in time order.
``video_token_count`` is the number of decoder positions one video takes: the dataset expands a ``<video>`` placeholder
to that many video tokens before the tower runs (packing, grouping and truncation see real lengths) and the model
fills exactly those positions, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def frame_tokens(self, grid: int) -> int:
        """Tokens of one frame whose feature grid is ``grid × grid`` (a pooling window that does not fit is dropped)."""
        side = grid // self.spatial_pool_stride
        if side < 1:
            raise ValueError(f"spatial_pool_stride {self.spatial_pool_stride} is larger than the {grid}x{grid} grid")
        return side * side


def video_token_count(cfg: VideoConfig, grid: int, frames: int) -> int:
    """Decoder positions of one video of ``frames`` sampled frames whose per-frame feature grid is ``grid × grid``."""
    if frames < 1:
        raise ValueError(f"a video needs at least one frame, got {frames}")
    return frames * cfg.frame_tokens(grid)
