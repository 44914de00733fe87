"""Built-in detail set: a fine pattern in an image larger than the tower's input, which a fixed-resolution model cannot
resolve and AnyRes tiles can (issue 23's demonstration that tiling pays, on a CPU in minutes).

Every image is ``SCALE × image_size`` pixels a side (64 px for the tiny 32 px tower), a flat background of a random
grey, and on it a square of half the image's side at a random even offset, filled with one of ``PATTERNS`` in black
and white at a one-pixel period with a random phase. The question is "What pattern fills the square?" (the pattern's
name; pretraining captions answer the same). Downscaled ``SCALE``× to the tower's size, as a fixed-resolution model
sees it, every pattern averages to the same mid grey (a one-pixel period is above the downscaled image's Nyquist
frequency; the resampling filter is symmetric, so the phase cannot show through): that model sees where the square
is but not what fills it, and can only guess (chance 1/3). AnyRes tiles of the tower's size keep full resolution,
where the three patterns are plain to see.

As in ``neva.data.synthetic_skills``, everything is a pure function of ``(seed, split, index)``; images are drawn on
demand from their names (``DetailImages``). The answer rule is exact match of the pattern's name
(``neva.evaluate --suite detail``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from neva.constants import IMAGE_TOKEN
from neva.data.synthetic import SPLITS

SCALE = 2  # image side / the tower's image_size: AnyRes takes it as a 2x2 grid of full-resolution tiles
PATTERNS = ("rows", "columns", "checks")
QUESTION = "What pattern fills the square?"
CAPTION = "Describe the image."
_EDGE = 6  # pixels over which the pattern fades in from its edge
_SALT = 23  # keeps this set's random streams apart from the other built-in sets' for the same seed


@dataclass(frozen=True)
class Detail:
    """One image: the pattern, its phase (0/1), where the square sits (``left``, ``top`` in [0, 1): fractions of the
    free margin, rounded down to even pixels) and the background grey."""

    pattern: str
    phase: int
    left: float
    top: float
    background: int


def detail(seed: int, split: str, index: int) -> Detail:
    """Image ``index`` of ``split`` (deterministic; the patterns in equal shares, ``index % 3``)."""
    rng = np.random.default_rng([seed, SPLITS[split], index, _SALT])
    return Detail(
        pattern=PATTERNS[index % len(PATTERNS)],
        phase=int(rng.integers(2)),
        left=float(rng.random()),
        top=float(rng.random()),
        background=int(rng.integers(40, 216)),
    )


def draw_detail(d: Detail, image_size: int) -> Image.Image:
    """RGB image of ``SCALE × image_size`` pixels a side."""
    side = SCALE * image_size
    square = side // 2
    img = np.full((side, side), d.background, dtype=np.uint8)
    # even offsets: the pattern's phase is its own, not the offset's
    top, left = (2 * int(f * (side - square) / 2) for f in (d.top, d.left))
    y, x = np.mgrid[:square, :square]
    bits = {"rows": y, "columns": x, "checks": x + y}[d.pattern]
    sign = np.where((bits + d.phase) % 2, 1.0, -1.0)
    # Full contrast inside, fading to the pattern's mean grey over the edge: a hard edge would let the resampling
    # filter's lobes show the phase along the pattern's stripes (rows at the top and bottom, columns at the sides).
    ramp = np.minimum(1.0, np.minimum(np.arange(square), np.arange(square)[::-1]) / _EDGE)
    ramp = np.sin(ramp * np.pi / 2) ** 2
    envelope = ramp[:, None] * ramp[None, :]
    img[top : top + square, left : left + square] = np.round(127.5 + 127.5 * sign * envelope).astype(np.uint8)
    return Image.fromarray(img).convert("RGB")


def image_name(split: str, index: int) -> str:
    """Name of sample ``index``'s image in records (resolved by ``DetailImages``)."""
    return f"detail/{split}/{index:06d}.png"


class DetailImages:
    """Picklable name → image function for ``CallableImageSource``; ``image_size``: the tower's."""

    def __init__(self, seed: int, image_size: int) -> None:
        self.seed = seed
        self.image_size = image_size

    def __call__(self, name: str) -> Image.Image:
        root, split, file = (name.split("/") + ["", ""])[:3]
        if root != "detail" or split not in SPLITS or not file.endswith(".png"):
            raise KeyError(name)
        return draw_detail(detail(self.seed, split, int(file[: -len(".png")])), self.image_size)


def detail_records(seed: int, split: str, num_samples: int, task: str) -> list[dict[str, Any]]:
    """``num_samples`` records of ``split``: captions (``task="caption"``) or the question (``"qa"``)."""
    prompt = CAPTION if task == "caption" else QUESTION
    return [
        {
            "id": f"detail-{split}-{i}",
            "image": image_name(split, i),
            "conversations": [
                {"from": "human", "value": f"{IMAGE_TOKEN}\n{prompt}"},
                {"from": "gpt", "value": detail(seed, split, i).pattern},
            ],
        }
        for i in range(num_samples)
    ]


def detail_eval_items(image_size: int, seed: int = 0, num_samples: int = 300) -> list[tuple[str, Image.Image, str]]:
    """The first ``num_samples`` held-out (``val``) questions: ``(question, image, answer)``, images at full size."""
    return [
        (QUESTION, draw_detail(d, image_size), d.pattern) for d in (detail(seed, "val", i) for i in range(num_samples))
    ]
