"""Per-sample visual budgets (``model.data.max_visual_tokens``): one record must not blow a step.

A sample's visual positions — every image's and every video's, together, as Qwen's ``VIDEO_TOTAL_PIXELS`` bounds a
video's frames together — are counted before the text is encoded; past the budget the record is, as
``model.data.visual_budget_action`` says:

- ``fewer_frames``: its videos keep fewer frames (one cap for all of them, the most that fits, taken uniformly from
  the frames sampled), the images untouched;
- ``downscale`` (towers whose positions follow from the pixels): native resolution: every image and frame of the
  record resized under a lower ``max_pixels``, the same for all, the highest that fits; AnyRes: every image resized
  by the largest factor of ``ANYRES_FACTORS`` (0.9ⁿ a side) under which its tiles fit;
- ``skip``: skipped, counted as ``visual_budget`` like every skip (``max_skip_fraction``).

A record that still does not fit (its images alone, at the smallest size) is skipped and counted. A record within the
budget is untouched. The samples changed are counted per action (``visual_budget`` in the batch: metrics.csv's
``data/visual_budget/<action>``), the first ones named in the log, and ``neva.data.preview`` shows the outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from neva.data.errors import SampleError
from neva.data.qwen_images import QwenImageSpec, video_token_count
from neva.data.records import record_images
from neva.data.video_decode import DecodedVideo

VISUAL_BUDGET_ACTIONS = ("skip", "fewer_frames", "downscale")
SKIP_REASON = "visual_budget"
# downscale: how many lower pixel budgets are tried (each aimed at the budget from the last one's count)
DOWNSCALE_TRIES = 8


@dataclass(frozen=True)
class VisualBudget:
    """``model.data.max_visual_tokens`` and ``visual_budget_action``."""

    max_tokens: int
    action: str = "skip"

    def over(self, total: int, what: str) -> SampleError:
        return SampleError(
            SKIP_REASON, f"{what}: {total} visual positions > model.data.max_visual_tokens={self.max_tokens}"
        )

    def fit_frames(
        self, image_tokens: int, frames: list[int], counts: list[Callable[[int], int]]
    ) -> tuple[list[int], str | None]:
        """(frames each video keeps, ``fewer_frames`` or None) so that ``image_tokens`` and the videos' positions
        (``counts[v](frames)``) fit: unchanged within the budget, else under ``fewer_frames`` one cap for every video,
        the most that fits.

        Raises:
            SampleError: ``visual_budget``, when nothing allowed fits.
        """
        total = image_tokens + sum(count(f) for count, f in zip(counts, frames))
        if total <= self.max_tokens:
            return frames, None
        if self.action == "fewer_frames":
            for cap in range(max(frames, default=1) - 1, 0, -1):
                kept = [min(f, cap) for f in frames]
                if image_tokens + sum(count(f) for count, f in zip(counts, kept)) <= self.max_tokens:
                    return kept, "fewer_frames"
        raise self.over(total, f"{image_tokens} image positions and {len(frames)} video(s) of {frames} frames")

    def max_pixels(self, count: Callable[[int], int], highest: int, lowest: int) -> int:
        """The highest ``max_pixels`` in ``[lowest, highest]`` found under which ``count(max_pixels)``, the record's
        visual positions, fits (``highest`` when it fits already).

        Raises:
            SampleError: ``visual_budget``, when it does not fit at ``lowest`` either.
        """
        pixels, total = highest, count(highest)
        for _ in range(DOWNSCALE_TRIES):
            if total <= self.max_tokens:
                return pixels
            if pixels == lowest:
                break
            # positions scale with pixels: aim just under the budget from the last count
            pixels = max(lowest, int(pixels * self.max_tokens / total * 0.98))
            total = count(pixels)
        if total <= self.max_tokens:
            return pixels
        raise self.over(count(highest), f"at the smallest max_pixels={pixels} still {total}")


class ScaledImages:
    """An image source's images resized by ``factor`` (each side, rounded; at least 1 px), sizes from the headers
    as the source gives them: how ``downscale`` shrinks an AnyRes record (its tiles and positions follow from the
    size). Composes the source, it does not subclass it."""

    def __init__(self, source: Any, factor: float) -> None:
        self.source, self.factor = source, factor

    def _scaled(self, height: int, width: int) -> tuple[int, int]:
        return max(1, round(height * self.factor)), max(1, round(width * self.factor))

    def size(self, name: str) -> tuple[int, int]:
        return self._scaled(*self.source.size(name))

    def load(self, name: str) -> Any:
        image = self.source.load(name)
        height, width = self._scaled(image.size[1], image.size[0])
        return image.resize((width, height), Image.BICUBIC)


# downscale of an AnyRes record: the side factors tried, largest first (positions change in steps of whole tiles)
ANYRES_FACTORS = tuple(round(0.9**i, 4) for i in range(1, 30))


def keep_frames(video: DecodedVideo, n: int) -> DecodedVideo:
    """``video`` with ``n`` of its sampled frames, spread uniformly over them (first and last kept)."""
    if n >= len(video.frames):
        return video
    keep = np.unique(np.linspace(0, len(video.frames) - 1, n).round().astype(int))
    return dataclasses.replace(video, frames=[video.frames[i] for i in keep], indices=[video.indices[i] for i in keep])


def fit_record(
    budget: VisualBudget,
    record: dict,
    num_image_tokens: int,
    image_source: Any,
    front_end: Any,
    videos: list[DecodedVideo],
    video_tokens: Callable[[int], int] | None,
) -> tuple[Any, Any, list[DecodedVideo], str | None]:
    """``(front end, image source, videos, action taken or None)`` that keep ``record`` within ``budget``: under
    ``downscale`` a native front end's copy under a lower ``max_pixels`` (images and frames), or for AnyRes the images
    resized (``ScaledImages``: fewer tiles); under ``fewer_frames`` the videos with fewer frames.

    ``num_image_tokens``: a fixed-size image's positions; ``video_tokens``: a video's positions by frames (a
    native tower's are counted from the decoded frames' size instead).

    Raises:
        SampleError: ``visual_budget`` (past the budget under ``skip``, or past it whatever is done).
    """
    n_images = len(record_images(record))

    def image_tokens(fe: Any) -> int:
        varying = fe.record_tokens(record, image_source)
        return n_images * num_image_tokens if varying is None else varying

    def per_video(fe: Any) -> list[Callable[[int], int]]:
        spec = getattr(fe, "processor", None)
        if isinstance(spec, QwenImageSpec):  # a native tower: from the frames' own size
            return [lambda f, v=v: video_token_count(spec, f, v.frames[0].height, v.frames[0].width) for v in videos]
        return [video_tokens] * len(videos)

    def total(fe: Any, frames: list[int]) -> int:
        return image_tokens(fe) + sum(count(f) for count, f in zip(per_video(fe), frames))

    frames = [len(v.frames) for v in videos]
    if budget.action == "downscale" and total(front_end, frames) > budget.max_tokens:
        if isinstance(getattr(front_end, "processor", None), QwenImageSpec):
            spec = front_end.processor
            pixels = budget.max_pixels(lambda m: total(front_end.with_max_pixels(m), frames), spec.max_pixels,
                                       spec.min_pixels)  # fmt: skip
            return front_end.with_max_pixels(pixels), image_source, videos, "downscale"
        videos_tokens = sum(count(f) for count, f in zip(per_video(front_end), frames))
        for factor in ANYRES_FACTORS:  # AnyRes: the images' tiles and positions follow from their size
            scaled = ScaledImages(image_source, factor)
            varying = front_end.record_tokens(record, scaled)
            if varying is not None and varying + videos_tokens <= budget.max_tokens:
                return front_end, scaled, videos, "downscale"
        n = total(front_end, frames)
        raise budget.over(n, f"{n_images} image(s) at {ANYRES_FACTORS[-1]} of their size still over")
    kept, action = budget.fit_frames(image_tokens(front_end), frames, per_video(front_end))
    return front_end, image_source, [keep_frames(v, n) for v, n in zip(videos, kept)], action
