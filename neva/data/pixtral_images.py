"""Images for Pixtral's tower (Mistral 3), patch-identical to transformers' ``PixtralImageProcessorPil`` as
``PixtralProcessor`` calls it (its ``patch_size`` the tower's × ``spatial_merge_size``), and the processor's image text.

An image keeps its aspect ratio: scaled down (sides floored) when its longer side exceeds ``longest_edge`` (the
tower's ``image_size``), then each side rounded up to a multiple of ``patch_size × merge`` (one merged token), RGB →
bicubic resize (PIL) → flattened patches ``[h·w, C·P·P]`` in merge-block order (``neva.data.qwen_images``'s layout at
one frame) with its grid (1, h, w). The patches stay uint8; the tower normalises them (OpenAI CLIP's statistics).

Its text (``PixtralProcessor.replace_image_token``): for each row of merged tokens, ``[IMG]`` × columns then
``[IMG_BREAK]``, the last ``[IMG_BREAK]`` replaced by ``[IMG_END]``. The conversation's encoder expands an image's
``[IMG]`` to the whole span (rows × (columns + 1)); the break and end positions then get their own ids here, so the
image's features go to the ``[IMG]`` positions only, in row-major order: the merger's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from neva.data.errors import SampleError
from neva.data.front_ends import EncodedImages
from neva.data.images import ImageError, ImageSource, safe_relative_path
from neva.data.qwen_images import QwenImageSpec, _resized, flatten_patches
from neva.data.records import record_images
from neva.errors import ConfigError


@dataclass(frozen=True)
class PixtralImageSpec:
    """One model's image geometry: ``patch_size``, ``merge`` patches per merged token side, ``longest_edge``."""

    patch_size: int
    merge: int
    longest_edge: int
    variable_tokens = True  # an image's positions follow from its size (serving asks ``tokens_of``)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """HF ``get_resize_output_image_size``: the (height, width) the image is resized to."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        f = self.factor
        return ((height - 1) // f + 1) * f, ((width - 1) // f + 1) * f

    def merged_grid(self, height: int, width: int) -> tuple[int, int]:
        """Rows and columns of merged tokens of an image of ``height`` × ``width`` pixels (from its header)."""
        h, w = self.resized_size(height, width)
        return h // self.factor, w // self.factor

    def span(self, height: int, width: int) -> int:
        """Decoder positions an image takes: its tokens and a break (or the end) after each row."""
        rows, columns = self.merged_grid(height, width)
        return rows * (columns + 1)

    def patches(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """One image → uint8 patches ``[h·w, C·P·P]`` (merge-block order) and its grid ``[1, 3]`` (1, h, w)."""
        size = self.resized_size(image.height, image.width)
        if min(size) < self.factor:  # HF's resize fails there too (a side scaled to 0 pixels)
            raise ImageError(
                "bad_aspect_ratio",
                f"image of {image.width}x{image.height} pixels: a side scales below one merged token ({self.factor} px)",
            )
        frame = _resized(image, size)
        geometry = QwenImageSpec(self.patch_size, 1, self.merge, 1, 1)
        patches, grid = flatten_patches(frame[None], geometry)
        return patches, torch.tensor([grid], dtype=torch.long)

    def tokens_of(self, images: list[Image.Image]) -> list[int]:
        """Each image's decoder positions (its span)."""
        return [self.span(image.height, image.width) for image in images]

    def patch_images(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every image's patches, image after image, and their grids ``[N, 3]`` (serving: ``neva.inference``)."""
        processed = [self.patches(image) for image in images]
        if not processed:
            return torch.zeros(0, 3 * self.patch_size**2, dtype=torch.uint8), torch.zeros(0, 3, dtype=torch.long)
        return torch.cat([p for p, _ in processed]), torch.cat([g for _, g in processed])

    def layout_ids(self, ids: list[int], grid: torch.Tensor, model: Any) -> list[int]:
        """Ids whose image spans (expanded as image tokens) get the model's break and end tokens (``mark_rows``)."""
        return mark_rows(
            ids, grid, self.merge, model.image_token_id, model.image_break_token_id, model.image_end_token_id
        )


def planned_image(vision: Any, size: tuple[int, int] | None) -> tuple[int, int, int, torch.Tensor]:
    """(height, width, decoder positions, feature offsets) of an image of ``size`` (height, width) as the front end
    resizes it, or of the largest one (None: a square of the longest edge): what the planner and the rehearsal count
    (``TowerSpec.native_sizes``); the offsets of its ``[IMG]`` positions within its span (each row's break or end
    skipped)."""
    spec = PixtralImageSpec(vision.patch_size, vision.spatial_merge_size, vision.image_size)
    h, w = spec.resized_size(*(size or (vision.image_size, vision.image_size)))
    rows, columns = spec.merged_grid(h, w)
    offsets = (torch.arange(rows)[:, None] * (columns + 1) + torch.arange(columns)).flatten()
    return h, w, spec.span(h, w), offsets


def mark_rows(ids: list[int], grid: torch.Tensor, merge: int, image_id: int, break_id: int, end_id: int) -> list[int]:
    """``ids`` whose image spans (each image's run of ``image_id``, in order, as the encoder expanded them) get
    ``break_id`` after each row of merged tokens and ``end_id`` last.

    Raises:
        ValueError: the ids do not hold the spans of ``grid``'s images.
    """
    out = list(ids)
    at = [i for i, t in enumerate(out) if t == image_id]
    start = 0
    for _, h, w in grid.tolist():
        rows, columns = h // merge, w // merge
        span = at[start : start + rows * (columns + 1)]
        if len(span) != rows * (columns + 1):
            raise ValueError(f"{len(at)} image positions do not hold the images' spans {grid.tolist()}")
        for r in range(rows):
            out[span[r * (columns + 1) + columns]] = break_id
        out[span[-1]] = end_id
        start += len(span)
    if start != len(at):
        raise ValueError(f"{len(at)} image positions for images spanning {start}")
    return out


class PixtralImages:
    """The front end: a record's images decoded before its text is encoded (their spans follow from their sizes);
    the sample carries every image's patches and grid (``image_grid``, the tower's and the merger's)."""

    size = 0
    image_tokens = 0
    reads_videos = False

    def __init__(self, model: Any) -> None:
        vision = model.vision
        self.processor = PixtralImageSpec(vision.patch_size, vision.spatial_merge_size, vision.image_size)
        self.ids = (model.image_token_id, model.image_break_token_id, model.image_end_token_id)
        if None in self.ids:
            raise ConfigError(
                "this pixtral model has no image_break_token_id / image_end_token_id: its tokenizer lacked "
                "[IMG_BREAK] / [IMG_END] when it was imported or built; import it with its tokenizer"
            )
        self.empty = torch.zeros(0, vision.patch_dim, dtype=torch.uint8)

    def encode(
        self, record: dict[str, Any], encode: Any, image_source: ImageSource, videos: list[Any] = ()
    ) -> EncodedImages:
        spec = self.processor
        processed = [spec.patches(image_source.load(safe_relative_path(n))) for n in record_images(record)]
        grid = torch.cat([g for _, g in processed]) if processed else torch.zeros(0, 3, dtype=torch.long)
        enc, _, tags = encode([(h // spec.merge) * (w // spec.merge + 1) for _, h, w in grid.tolist()])
        try:
            ids = mark_rows(enc.input_ids, grid, spec.merge, *self.ids)
        except ValueError as err:  # a span cut by truncation
            raise ImageError("image_truncated", str(err)) from None
        pixels = torch.cat([p for p, _ in processed]) if processed else self.empty
        enc = dataclasses.replace(enc, input_ids=ids)
        return EncodedImages(enc, tags, pixels, len(processed), {"image_grid": grid})

    def record_tokens(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        """The decoder positions of a record's images (their spans, breaks included) from their headers."""
        try:
            sizes = [image_source.size(safe_relative_path(name)) for name in record_images(record)]
        except SampleError:
            return None  # skipped (and counted) when read
        return sum(self.processor.span(h, w) for h, w in sizes)

    def record_patches(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        """The tower's patches (h·w per image), 0 where a header cannot be read (the sample is skipped when read)."""
        try:
            sizes = [image_source.size(safe_relative_path(name)) for name in record_images(record)]
        except SampleError:
            return 0
        f = self.processor
        return sum(r * c * f.merge**2 for r, c in (f.merged_grid(h, w) for h, w in sizes))


def pixtral_images(
    vision: Any, model: Any, image_aspect_ratio: str, min_pixels: int | None = None, max_pixels: int | None = None
) -> PixtralImages:
    """Pixtral's front end (``TowerSpec.front_end``); its budget is the tower's longest edge, not a pixel count."""
    if model is None:
        raise ConfigError("a pixtral front end needs the model config (its image, break and end token ids)")
    return PixtralImages(model)
