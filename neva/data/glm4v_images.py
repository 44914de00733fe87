"""GLM-4.1V's image resize (``Glm4vImageProcessor``'s ``smart_resize``, transformers 5.25), the ``glm4v`` family's
``TowerSpec.fit`` for ``neva.data.qwen_images``: an image is first scaled up so that neither side is shorter than
one merged token (``factor`` pixels, truncated to integers), then sized as Qwen's rule does except that the pixel
budget counts the ``temporal_patch_size`` frames the image is repeated to (``t·h·w`` against ``min_pixels`` /
``max_pixels``), so a still image gets half the area a Qwen processor with the same numbers gives it."""

from __future__ import annotations

import math
from typing import Any

from neva.data.images import ImageError

MAX_ASPECT_RATIO = 200


def glm4v_resize(spec: Any, height: int, width: int) -> tuple[int, int]:
    """The (height, width) ``Glm4vImageProcessor`` resizes an image of ``height`` × ``width`` pixels to."""
    factor, frames = spec.factor, spec.temporal_patch_size
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            "bad_aspect_ratio",
            f"image of {height}x{width} pixels: aspect ratio above {MAX_ASPECT_RATIO} (GLM-4.1V's smart_resize limit)",
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if frames * h_bar * w_bar > spec.max_pixels:
        beta = math.sqrt(frames * height * width / spec.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
