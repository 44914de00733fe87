"""The image workload a plan assumes: decoder positions and tower inputs per image, by the data side's one rule.

A fixed-size image is one tower input of ``num_image_tokens`` positions. An AnyRes image's tiles and positions follow
from its size (``neva.models.anyres.feature_index``, what the dataset computes); the planner takes ``plan.image_size``
(a typical size of the data) or, by default, the worst case: an image of the largest pinpoint, all of whose tiles
are kept (OneVision's ``anyres_max_N`` pools its positions, not its tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

from neva.models.anyres import feature_index, largest_pinpoint
from neva.models.config import NevaConfig


@dataclass(frozen=True)
class ImageLoad:
    """Per image: decoder ``tokens``, tower inputs (``tiles``) and the ``(height, width)`` assumed (None: fixed)."""

    tokens: int
    tiles: int
    size: tuple[int, int] | None = None

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "tiles": self.tiles, "size": None if self.size is None else list(self.size)}


def parse_image_size(text: str) -> tuple[int, int]:
    """``plan.image_size=HxW`` (pixels, height first as everywhere in neva's AnyRes)."""
    h, sep, w = text.lower().partition("x")
    if not sep or not h.isdigit() or not w.isdigit():
        raise ValueError(f"plan.image_size={text!r}: expected HEIGHTxWIDTH in pixels, e.g. 672x1008")
    return int(h), int(w)


def image_load(cfg: NevaConfig, size: tuple[int, int] | None = None) -> ImageLoad:
    """The workload of one image of ``size`` (None: AnyRes's worst case, the largest pinpoint)."""
    if cfg.vision is None:
        return ImageLoad(0, 0)
    if cfg.anyres is None:
        return ImageLoad(cfg.num_image_tokens, 1)
    if size is None:
        size = largest_pinpoint(cfg.anyres)
    lay = feature_index(cfg.anyres, cfg.num_image_tokens, cfg.vision.image_size, size)
    return ImageLoad(lay.tokens, lay.tiles, (int(size[0]), int(size[1])))


def describe_images(image: dict) -> str:
    """The line ``neva.plan`` prints under its table for an AnyRes plan (``ImageLoad.to_dict``)."""
    h, w = image["size"]
    return (
        f"# AnyRes images of {h}x{w} px: {image['tiles']} tiles through the tower, {image['tokens']} decoder "
        "positions each (plan.image_size=HxW; default: the largest pinpoint)"
    )
