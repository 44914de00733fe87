"""InternVL's dynamic tiling: an image → its tiles and thumbnail, uint8, pixel-identical to transformers'
``GotOcr2ImageProcessor`` (PIL backend) with ``crop_to_patches`` on, as ``InternVLProcessor`` calls it.

Steps (tile side ``s`` = the tower's ``image_size``, 448 for InternVL):

1. the grid: among every (columns, rows) with ``min_tiles`` ≤ columns · rows ≤ ``max_tiles`` (ordered by tile
   count), the one whose aspect ratio columns / rows is closest to the image's width / height; on a tie the later
   (more tiles) wins while the image's area exceeds half the grid's (HF ``get_optimal_tiled_canvas``);
2. bicubic resize of the whole image to (columns · s, rows · s), aspect ratio not kept, cut into tiles row-major;
3. where there is more than one tile, the thumbnail: the whole image resized (bicubic) to s × s, last.

Each tile is one tower input of ``num_image_tokens`` (256) positions, so an image takes tiles × 256 positions, written
``<img>`` + ``<IMG_CONTEXT>`` × that + ``</img>`` (the ``internvl`` template's image block; the encoder expands the
context token like any image token). The tower normalises with ImageNet's statistics on the device, as every tower.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import Image

from neva.data.errors import SampleError
from neva.data.front_ends import EncodedImages
from neva.data.images import ImageSource, safe_relative_path
from neva.data.records import record_images

MIN_TILES, MAX_TILES = 1, 12
"""InternVL 3 / 3.5's ``min_dynamic_patch`` / ``max_dynamic_patch`` (their fine-tuning scripts and hub processors)."""


@lru_cache(maxsize=16)
def tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) with ``min_tiles`` ≤ columns · rows ≤ ``max_tiles``, by tile count (stable)."""
    grids = [
        (w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1) if min_tiles <= w * h <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def best_grid(height: int, width: int, tile: int, min_tiles: int = MIN_TILES, max_tiles: int = MAX_TILES) -> tuple:
    """(columns, rows) of an image of ``height`` × ``width`` (step 1 of the module docstring)."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in tile_grids(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


def tile_count(height: int, width: int, tile: int, min_tiles: int = MIN_TILES, max_tiles: int = MAX_TILES) -> int:
    """Tower inputs of an image: its grid's tiles, plus the thumbnail where there is more than one
    (HF ``get_number_of_image_patches``)."""
    if max_tiles <= 1:
        return 1
    columns, rows = best_grid(height, width, tile, min_tiles, max_tiles)
    return 1 if columns * rows == 1 else columns * rows + 1


def planned_tiles(size: tuple[int, int] | None, tile: int) -> int:
    """The tower inputs the planner counts for an image of ``size`` (height, width), or for the worst case (None):
    the most tiles and the thumbnail (``TowerSpec.tiles``)."""
    return MAX_TILES + 1 if size is None else tile_count(size[0], size[1], tile)


@dataclass(frozen=True)
class TileProcessor:
    """One model's tiling: tile side ``size`` (the tower's), ``image_tokens`` positions per tile."""

    size: int
    image_tokens: int
    min_tiles: int = MIN_TILES
    max_tiles: int = MAX_TILES
    variable_tokens = True  # an image's positions follow from its size (serving asks ``tokens_of``)

    def tiles_of(self, image: Image.Image) -> torch.Tensor:
        """RGB image → uint8 ``[tiles, 3, size, size]``: the tiles row-major, then the thumbnail (if more than one)."""
        image = image.convert("RGB")
        s = self.size
        if self.max_tiles <= 1:
            return _chw(np.asarray(image.resize((s, s), resample=Image.BICUBIC)))[None]
        columns, rows = best_grid(image.height, image.width, s, self.min_tiles, self.max_tiles)
        canvas = torch.from_numpy(np.asarray(image.resize((columns * s, rows * s), resample=Image.BICUBIC)).copy())
        tiles = canvas.permute(2, 0, 1).unflatten(1, (rows, s)).unflatten(3, (columns, s))
        tiles = tiles.permute(1, 3, 0, 2, 4).flatten(0, 1)  # [rows·columns, 3, s, s], row-major
        if columns * rows > 1:
            thumbnail = _chw(np.asarray(image.resize((s, s), resample=Image.BICUBIC)))
            tiles = torch.cat([tiles, thumbnail[None]])
        return tiles.contiguous()

    def tiles(self, images: list[Image.Image]) -> torch.Tensor:
        """Every image's tiles, image after image (``neva.inference.load_pixels``)."""
        if not images:
            return torch.zeros(0, 3, self.size, self.size, dtype=torch.uint8)
        return torch.cat([self.tiles_of(image) for image in images])

    def count(self, height: int, width: int) -> int:
        return tile_count(height, width, self.size, self.min_tiles, self.max_tiles)

    def tokens_of(self, images: list[Image.Image]) -> list[int]:
        """Each image's decoder positions: its tower inputs × ``image_tokens``."""
        return [self.count(image.height, image.width) * self.image_tokens for image in images]


def _chw(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


class TiledInternVL:
    """The front end: a record's images are decoded and tiled before its text is encoded (their positions follow
    from their sizes); the sample's tower inputs are every image's tiles, each taking the model's fixed count, so
    ``image_count`` is the record's tiles (what the model's check of positions found from ids counts in)."""

    reads_videos = False

    def __init__(self, processor: TileProcessor) -> None:
        self.processor = processor
        self.size = processor.size
        self.image_tokens = processor.image_tokens  # a tile's

    def encode(
        self, record: dict[str, Any], encode: Any, image_source: ImageSource, videos: list[Any] = ()
    ) -> EncodedImages:
        loaded = [image_source.load(safe_relative_path(name)) for name in record_images(record)]
        enc, _, tags = encode(self.processor.tokens_of(loaded))
        pixels = self.processor.tiles(loaded)
        return EncodedImages(enc, tags, pixels, pixels.shape[0])

    def record_tokens(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        try:
            sizes = [image_source.size(safe_relative_path(name)) for name in record_images(record)]
        except SampleError:
            return None  # the sample is skipped (and counted) when it is read; its length here is a guess
        return sum(self.processor.count(h, w) for h, w in sizes) * self.image_tokens

    def record_patches(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        return None  # a tile is one fixed-size tower pass: the token lengths already weigh the tower's work


def internvl_tiles(
    vision: Any, model: Any, image_aspect_ratio: str, min_pixels: int | None = None, max_pixels: int | None = None
) -> TiledInternVL:
    """InternVL's front end (``TowerSpec.front_end``): tiles of the tower's size, the model's positions per tile
    (after the projector's pixel shuffle where the model is known)."""
    tokens = vision.num_image_tokens if model is None else model.num_image_tokens
    return TiledInternVL(TileProcessor(vision.image_size, tokens))
