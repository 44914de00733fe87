"""The image workload a plan assumes: decoder positions and tower inputs per image, by the data side's one rule.

A fixed-size image is one tower input of ``num_image_tokens`` positions. An AnyRes image's tiles and positions follow
from its size (``neva.models.anyres.feature_index``, what the dataset computes); the planner takes ``plan.image_size``
(a typical size of the data), ``plan.image_tokens=N`` (the data's mean positions per image), ``plan.image_tokens=data``
(that mean measured from the configured data's image headers, ``neva.planner.image_mix``) or, by default, the worst
case: an image of the largest pinpoint, all of whose tiles are kept (OneVision's ``anyres_max_N`` pools its
positions, not its tiles). A mean is rounded up to whole positions and tiles.

A tower whose front end tiles every image by its own rule (InternVL: ``TowerSpec.tiles``) takes that rule's tiles of
``plan.image_size``, or by default its largest count (12 tiles and the thumbnail), each tile the fixed count.

A native-resolution tower (Qwen-VL) takes each image at its own size within the pixel budget: its "tiles" are then its
patches (the FLOP model's unit for such a tower, ``neva.models.flops``) and its positions patches / merge². The
planner takes ``plan.image_size`` resized by the data side's ``smart_resize``, or by default the worst case: the
largest image ``plan.max_pixels`` lets through (default the data's ``model.data.max_pixels``, else the tower kind's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neva.data.config import DataConfig
from neva.data.images import ImageError
from neva.data.qwen_images import QwenImageSpec, budget_size, resized_size
from neva.families import part
from neva.models.anyres import feature_index, largest_pinpoint
from neva.models.config import NevaConfig
from neva.planner.image_mix import measure_image_mix
from neva.typed import ConfigError


@dataclass(frozen=True)
class ImageLoad:
    """Per image: decoder ``tokens``, tower inputs (``tiles``) and the ``(height, width)`` assumed (None: fixed)."""

    tokens: int
    tiles: int  # a native tower's: patches
    size: tuple[int, int] | None = None
    source: str | None = None  # where a mean per image comes from (plan.image_tokens); None: one image of ``size``
    grid: tuple[int, int] | None = None  # a native tower's image in patches (height, width)
    max_pixels: int | None = None  # a native tower's pixel budget
    tiled: bool = False  # tiled by its family's own rule (``TowerSpec.tiles``), not AnyRes

    def to_dict(self) -> dict:
        out = {"tokens": self.tokens, "tiles": self.tiles, "size": None if self.size is None else list(self.size)}
        if self.grid is not None:
            out.update(grid=list(self.grid), max_pixels=self.max_pixels)
        if self.tiled:
            out["tiled"] = True
        return out if self.source is None else {**out, "source": self.source}


def parse_image_size(text: str) -> tuple[int, int]:
    """``plan.image_size=HxW`` (pixels, height first as everywhere in neva's AnyRes)."""
    h, sep, w = text.lower().partition("x")
    if not sep or not h.isdigit() or not w.isdigit():
        raise ValueError(f"plan.image_size={text!r}: expected HEIGHTxWIDTH in pixels, e.g. 672x1008")
    return int(h), int(w)


def parse_image_tokens(text: str) -> float | str:
    """``plan.image_tokens=N`` (mean decoder positions per image, > 0) or ``plan.image_tokens=data``."""
    if text == "data":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or math.isinf(value):
        raise ValueError(f"plan.image_tokens={text!r}: expected a positive mean of positions per image, or 'data'")
    return value


def parse_max_pixels(text: str) -> int:
    """``plan.max_pixels=N`` (a native tower's pixel budget per image, > 0)."""
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"plan.max_pixels={text!r}: expected a positive number of pixels, e.g. 1003520")
    return int(text)


def image_load(
    cfg: NevaConfig,
    size: tuple[int, int] | None = None,
    tokens: float | str | None = None,
    data: DataConfig | None = None,
    max_pixels: int | None = None,
) -> ImageLoad:
    """The workload of one image of ``size`` (None: AnyRes's worst case, the largest pinpoint), or of the mean image:
    ``tokens`` positions (its tiles: as many as those positions fill at one tile's count, fewer than real for pooled
    ``anyres_max_N`` images), or ``"data"``: measured from ``data`` (``measure_image_mix``). A native tower: the
    image of ``size`` resized within the budget, or the largest the budget lets through (``native_image_load``).

    Raises:
        ConfigError: ``tokens`` on a model without AnyRes, with ``size``, or a survey that cannot run.
    """
    if tokens is not None:
        if cfg.anyres is None or size is not None:
            raise ConfigError("plan.image_tokens needs an AnyRes model (model.mm_cfg.image_grid_pinpoints) and no "
                              "plan.image_size")  # fmt: skip
        if tokens == "data":
            mix = measure_image_mix(cfg, data or DataConfig())
            return ImageLoad(math.ceil(mix.tokens), math.ceil(mix.tiles), None, mix.describe())
        tiles = max(1, math.ceil(tokens / cfg.num_image_tokens))
        return ImageLoad(math.ceil(tokens), tiles, None, f"plan.image_tokens={tokens:g}; tiles: positions / "
                         f"{cfg.num_image_tokens} per tile, rounded up")  # fmt: skip
    if cfg.vision is None:
        return ImageLoad(0, 0)
    if cfg.vision.spec.patch_grid:
        return native_image_load(cfg, size, data or DataConfig(), max_pixels)
    if cfg.anyres is None and cfg.vision.spec.tiles is not None:  # tiled by its front end's rule (InternVL)
        tiles = part(cfg.vision.spec.tiles)(size, cfg.vision.image_size)
        size = None if size is None else (int(size[0]), int(size[1]))
        return ImageLoad(tiles * cfg.num_image_tokens, tiles, size, tiled=True)
    if cfg.anyres is None:
        return ImageLoad(cfg.num_image_tokens, 1)
    if size is None:
        size = largest_pinpoint(cfg.anyres)
    lay = feature_index(cfg.anyres, cfg.num_image_tokens, cfg.vision.image_size, size)
    return ImageLoad(lay.tokens, lay.tiles, (int(size[0]), int(size[1])))


def native_image_load(
    cfg: NevaConfig, size: tuple[int, int] | None, data: DataConfig, max_pixels: int | None
) -> ImageLoad:
    """A native tower's image: ``size`` resized as the data side does, or the budget's largest (``budget_size``)
    under ``max_pixels`` (None: ``data.max_pixels``, else the tower kind's); its patches and positions.

    Raises:
        ConfigError: a budget below ``model.data.min_pixels``, or an image ``smart_resize`` refuses.
    """
    sizes = cfg.vision.spec.native_sizes
    if sizes is not None:  # its own sizing rule (Pixtral's longest edge): no pixel budget
        h, w, tokens, _ = part(sizes)(cfg.vision, size)
        grid = (h // cfg.vision.patch_size, w // cfg.vision.patch_size)
        return ImageLoad(tokens, grid[0] * grid[1], (h, w), grid=grid)
    budget = max_pixels or data.max_pixels
    try:
        spec = QwenImageSpec.for_tower(cfg.vision, data.min_pixels, budget)
        h, w = budget_size(spec) if size is None else resized_size(spec, *size)
    except (ValueError, ImageError) as err:
        raise ConfigError(f"plan.max_pixels / plan.image_size: {err}") from None
    grid = (h // spec.patch_size, w // spec.patch_size)
    patches = grid[0] * grid[1]
    return ImageLoad(patches // spec.merge_size**2, patches, (h, w), grid=grid, max_pixels=spec.max_pixels)


def describe_images(image: dict) -> str:
    """The line ``neva.plan`` prints under its table for an AnyRes or native-resolution plan
    (``ImageLoad.to_dict``)."""
    if "grid" in image:
        (h, w), (gh, gw) = image["size"], image["grid"]
        budget = "" if image["max_pixels"] is None else f" (max_pixels {image['max_pixels']})"
        largest = (
            "the longest edge's square" if image["max_pixels"] is None else "the largest plan.max_pixels lets through"
        )
        return (
            f"# native-resolution images of {h}x{w} px{budget}: {gh}x{gw} = "
            f"{image['tiles']} patches through the tower, {image['tokens']} decoder positions each "
            f"(plan.image_size=HxW; default: {largest})"
        )
    if image.get("tiled"):
        what = "images" if image["size"] is None else "images of {}x{} px".format(*image["size"])
        return (
            f"# tiled {what}: {image['tiles']} tiles through the tower, {image['tokens']} decoder positions each "
            "(plan.image_size=HxW; default: the tiling rule's most tiles)"
        )
    if "source" in image:
        return (
            f"# AnyRes images: {image['tiles']} tiles through the tower, {image['tokens']} decoder positions each "
            f"(mean per image, {image['source']})"
        )
    h, w = image["size"]
    return (
        f"# AnyRes images of {h}x{w} px: {image['tiles']} tiles through the tower, {image['tokens']} decoder "
        "positions each (plan.image_size=HxW; default: the largest pinpoint)"
    )
