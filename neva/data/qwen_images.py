"""Images and videos for the native-resolution Qwen towers, patch-identical to ``Qwen2VLImageProcessorPil`` (the PIL
backend of transformers' ``Qwen2VLImageProcessor``, which Qwen2.5-VL and Qwen3-VL use too, with their own settings).

An image keeps its aspect ratio: ``smart_resize`` picks the nearest size whose sides are multiples of ``patch_size ×
merge_size`` with ``min_pixels`` ≤ h·w ≤ ``max_pixels``; RGB → bicubic resize (PIL) → the frame repeated to
``temporal_patch_size`` → flattened patches ``[L, C·T·P·P]`` (channels outer, then the T frames, then P × P pixels),
in merge-block order (``merge_size``² neighbouring patches consecutive, blocks row-major) with its grid (t, h, w) in
patches. The patches stay uint8 here; ``/255`` and the mean/std normalisation run in the tower, in fp32
(``neva.models.native_vision.normalize_patches``), as for CLIP. A video's frames (all of one size) are resized
alike and grouped ``temporal_patch_size`` at a time, the last frame repeated to fill the last group (the HF video
processors' padding); the frame sampling and the video processors' own pixel budgets are the caller's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from neva.data.images import ImageError
from neva.errors import ConfigError
from neva.families import part
from neva.models.config import VisionConfig

MAX_ASPECT_RATIO = 200  # smart_resize refuses longer sides than this many times the shorter one (as Qwen's)


@dataclass(frozen=True)
class QwenImageSpec:
    """How images become a native tower's patches: the tower's patch geometry and the pixel budget."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    # The family's own resize rule (``TowerSpec.fit``, ``(spec, height, width) -> (height, width)``); None: Qwen's
    # ``smart_resize``.
    fit: str | None = None

    @classmethod
    def for_tower(cls, cfg: VisionConfig, min_pixels: int | None = None, max_pixels: int | None = None):
        """The spec of tower ``cfg`` (a native kind); ``min_pixels`` / ``max_pixels`` None: its family's defaults
        (``TowerSpec.pixels``)."""
        if not cfg.spec.patch_grid:
            raise ValueError(f"a {cfg.kind} tower reads fixed-size images, not native-resolution patches")
        low, high = cfg.spec.pixels
        if (min_pixels is None) != (max_pixels is None) and not (min_pixels or low) <= (max_pixels or high):
            given, value = ("max_pixels", max_pixels) if min_pixels is None else ("min_pixels", min_pixels)
            other = "min_pixels" if given == "max_pixels" else "max_pixels"
            raise ConfigError(
                f"{given}={value} is on the wrong side of the {cfg.kind} tower's default {other}="
                f"{low if other == 'min_pixels' else high}: give {other} too (model.data.{other})"
            )
        return cls(
            cfg.patch_size,
            cfg.temporal_patch_size,
            cfg.spatial_merge_size,
            low if min_pixels is None else min_pixels,
            high if max_pixels is None else max_pixels,
            cfg.spec.fit,
        )

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} and max_pixels {self.max_pixels}: need 0 < min <= max")

    @property
    def factor(self) -> int:
        """Pixels per side of one merged token: both resized sides are multiples of it."""
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's resize target (height, width): each side rounded to a multiple of ``factor``; if the area then exceeds
    ``max_pixels`` both sides scale down by ``sqrt(h·w / max_pixels)`` (floored to multiples, at least ``factor``),
    if it falls below ``min_pixels`` up by ``sqrt(min_pixels / (h·w))`` (ceiled)."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ImageError(
            "bad_aspect_ratio",
            f"image of {height}x{width} pixels: aspect ratio above {MAX_ASPECT_RATIO} (Qwen's smart_resize limit)",
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_size(spec: QwenImageSpec, height: int, width: int) -> tuple[int, int]:
    if spec.fit is not None:
        return part(spec.fit)(spec, height, width)
    return smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)


def image_grid(spec: QwenImageSpec, height: int, width: int) -> tuple[int, int, int]:
    """(t, h, w) in patches of an image of ``height`` × ``width`` pixels: from its header, without decoding it."""
    h, w = resized_size(spec, height, width)
    return 1, h // spec.patch_size, w // spec.patch_size


def budget_size(spec: QwenImageSpec) -> tuple[int, int]:
    """The resized (height, width) of the largest image the pixel budget lets through: a square of ``max_pixels``
    (any larger image is scaled down to about as many pixels; the planner's worst case)."""
    side = math.isqrt(spec.max_pixels)
    return resized_size(spec, side, side)


def image_token_count(spec: QwenImageSpec, height: int, width: int) -> int:
    """Decoder positions of one image of ``height`` × ``width`` pixels (t·h·w / merge²), from its size alone."""
    t, h, w = image_grid(spec, height, width)
    return t * h * w // spec.merge_size**2


def video_token_count(spec: QwenImageSpec, frames: int, height: int, width: int) -> int:
    """Decoder positions of ``frames`` frames of ``height`` × ``width`` pixels (each frame resized as an image)."""
    _, h, w = image_grid(spec, height, width)
    return -(-frames // spec.temporal_patch_size) * h * w // spec.merge_size**2


def native_video_estimate(spec: QwenImageSpec, frames: int) -> int:
    """Decoder positions of a video of ``frames`` frames at the pixel budget's largest size: the length a record is
    sorted and planned by before its video is decoded (its sample then counts its own frames' size)."""
    return video_token_count(spec, frames, *budget_size(spec))


def video_second_per_grid(spec: QwenImageSpec, sampled: int, total: int, rate: float) -> float:
    """Qwen2.5-VL's ``second_per_grid_ts`` of one video: ``temporal_patch_size / fps`` with fps the sampled rate,
    ``sampled / total × rate`` (``sampled`` frames taken of the file's ``total`` at ``rate`` frames/s), as its
    processor computes it (transformers' ``VideoMetadata.sampled_fps``)."""
    return spec.temporal_patch_size / (sampled / total * rate)


def flatten_patches(frames: torch.Tensor, spec: QwenImageSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 frames ``[F, C, H, W]`` (sides multiples of ``factor``) → patches ``[t·h·w, C·T·P·P]`` in the processor's
    order and the grid (t, h, w); the last frame repeated up to a multiple of ``temporal_patch_size``."""
    count, channels, height, width = frames.shape
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if height % spec.factor or width % spec.factor:
        raise ValueError(f"frames of {height}x{width} pixels: sides must be multiples of {spec.factor}")
    if pad := -count % tp:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t, h, w = frames.shape[0] // tp, height // p, width // p
    patches = frames.reshape(t, tp, channels, h // m, m, p, w // m, m, p)
    # (t, block row, block column, row in block, column in block, channel, frame in group, pixel row, pixel column)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, channels * tp * p * p), (t, h, w)


def _resized(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """RGB, bicubic PIL resize to ``size`` (height, width) → uint8 ``[C, H, W]``."""
    arr = np.asarray(image.convert("RGB").resize((size[1], size[0]), resample=Image.BICUBIC))
    return torch.from_numpy(arr.copy()).permute(2, 0, 1)


def image_patches(image: Image.Image, spec: QwenImageSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """One image → uint8 patches ``[t·h·w, C·T·P·P]`` and its grid ``[1, 3]`` long (t = 1)."""
    frame = _resized(image, resized_size(spec, image.height, image.width))
    patches, grid = flatten_patches(frame[None], spec)
    return patches, torch.tensor([grid], dtype=torch.long)


def video_patches(frames: list[Image.Image], spec: QwenImageSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled frames of one video (one size) → uint8 patches and the grid ``[1, 3]`` (t = frame groups)."""
    if not frames:
        raise ImageError("corrupt_video", "a video without frames")
    size = resized_size(spec, frames[0].height, frames[0].width)
    if any((f.height, f.width) != (frames[0].height, frames[0].width) for f in frames):
        raise ImageError("corrupt_video", "video frames of different sizes")
    patches, grid = flatten_patches(torch.stack([_resized(f, size) for f in frames]), spec)
    return patches, torch.tensor([grid], dtype=torch.long)
