"""LLaVA-NeXT AnyRes tiling: an image → the overview and the tiles of its best grid, uint8, pixel-identical to
transformers' ``LlavaNextImageProcessor`` (its PIL backend).

Steps (``image_aspect_ratio: anyres``):

1. the best pinpoint for the image's size (``neva.models.anyres.select_best_resolution``);
2. bicubic resize keeping the aspect ratio so that it fits the pinpoint (the bound side exact, the other
   ``min(ceil(side * scale), target)``), then centred padding with black (0) to the pinpoint;
3. tiles of ``image_size`` × ``image_size``, row-major;
4. the overview: the whole image resized (bicubic, aspect ratio not kept) to ``image_size`` × ``image_size``,
   first.

Tiles already have the tower's input size, so the processor's per-tile resize and crop change nothing, for CLIP and
SigLIP alike; the tower's own mean/std normalise them on the device, as for every image. LLaVA-NeXT's original code
does the same (black padding, squashed overview).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from PIL import Image

from neva.data.images import ImageProcessor
from neva.models.anyres import (
    AnyResConfig,
    Layout,
    concat_layouts,
    feature_index,
    image_token_count,
    select_best_resolution,
)
from neva.models.config import NevaConfig


def resize_and_pad(image: Image.Image, target_hw: tuple[int, int]) -> np.ndarray:
    """Aspect-preserving bicubic resize into ``target_hw`` (height, width), centred on black: uint8 ``[H, W, 3]``."""
    w, h = image.size
    th, tw = target_hw
    if tw / w < th / h:
        new_w, new_h = tw, min(math.ceil(h * tw / w), th)
    else:
        new_w, new_h = min(math.ceil(w * th / h), tw), th
    resized = np.asarray(image.resize((new_w, new_h), resample=Image.BICUBIC))
    out = np.zeros((th, tw, 3), dtype=np.uint8)
    top, left = (th - new_h) // 2, (tw - new_w) // 2
    out[top : top + new_h, left : left + new_w] = resized
    return out


def tile_image(image: Image.Image, cfg: AnyResConfig, image_size: int) -> torch.Tensor:
    """RGB image → uint8 ``[1 + rows·cols, 3, image_size, image_size]``: the overview, then the tiles row-major."""
    w, h = image.size
    th, tw = select_best_resolution((h, w), cfg.grid_pinpoints)
    padded = torch.from_numpy(resize_and_pad(image, (th, tw))).permute(2, 0, 1)
    tiles = padded.unflatten(1, (th // image_size, image_size)).unflatten(3, (tw // image_size, image_size))
    tiles = tiles.permute(1, 3, 0, 2, 4).flatten(0, 1)  # [rows·cols, 3, s, s], row-major
    overview = torch.from_numpy(np.array(image.resize((image_size, image_size), resample=Image.BICUBIC)))
    return torch.cat([overview.permute(2, 0, 1)[None], tiles]).contiguous()


class AnyResProcessor:
    """``image_aspect_ratio: anyres`` / ``anyres_max_N``: the ``ImageProcessor`` interface for tiled images of varying
    token counts.

    ``__call__`` gives an image's tiles (``tile_image``). ``sizes`` / ``layouts`` / ``tiles`` take a sample's images
    together: each image's feature index over its tiles (``neva.models.anyres.feature_index``: its length is the
    image's decoder positions) follows from the sizes only, so the dataset knows every sample's real length before
    the tower runs. LLaVA-OneVision (``anyres_max_N``) tiles an image only when it is its sample's only one; the
    images of a multi-image sample are padded to a square, one tile each (transformers' ``batch_num_images``,
    LLaVA-NeXT's ``train.py`` ``process_image(f, "pad")``).
    """

    variable_tokens = True

    def __init__(self, model: NevaConfig) -> None:
        if model.anyres is None or model.vision is None:
            raise ValueError(
                "image_aspect_ratio=anyres needs a model with AnyRes (image_grid_pinpoints) and a vision tower"
            )
        self.cfg = model.anyres
        self.size = model.vision.image_size
        self.tile_tokens = model.num_image_tokens
        self.pad = ImageProcessor(model.vision, "pad")

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return tile_image(image.convert("RGB"), self.cfg, self.size)

    def sizes(self, images: list[Image.Image]) -> list[tuple[int, int] | None]:
        """Each image's ``(height, width)`` for its layout; None: one fixed-size (padded) tile."""
        return self.layout_sizes([(im.size[1], im.size[0]) for im in images])

    def layout_sizes(self, sizes: list[tuple[int, int]]) -> list[tuple[int, int] | None]:
        """A sample's image sizes ``(height, width)`` as its layouts take them (None: one padded tile)."""
        if self.cfg.max_num_patches is not None and len(sizes) > 1:
            return [None] * len(sizes)
        return list(sizes)

    def tokens(self, sizes: list[tuple[int, int]]) -> int:
        """Decoder positions of a sample's images of ``sizes`` (the same rule as ``layouts``)."""
        return sum(image_token_count(self.cfg, self.tile_tokens, self.size, s) for s in self.layout_sizes(sizes))

    def layouts(self, images: list[Image.Image]) -> list[Layout]:
        """Each image's ``Layout`` over its own tiles (-1 = newline)."""
        return [feature_index(self.cfg, self.tile_tokens, self.size, s) for s in self.sizes(images)]

    def tiles(self, images: list[Image.Image]) -> torch.Tensor:
        """uint8 ``[tiles, 3, s, s]``: every image's tiles, in image order."""
        return torch.cat(
            [self(im) if s is not None else self.pad(im)[None] for im, s in zip(images, self.sizes(images))]
        )


def anyres_sample_fields(layouts: list[Layout], tile_tokens: int) -> dict[str, Any]:
    """A sample's AnyRes fields: its images' feature index (and, pooled, weights) over the sample's tiles, and the
    features per tile (the collator offsets the index by the tiles before the sample)."""
    lay = concat_layouts(layouts, tile_tokens)
    fields = {"image_feature_index": lay.index, "tile_tokens": tile_tokens}
    if lay.weight is not None:
        fields["image_feature_weight"] = lay.weight
    return fields


def sample_layout(sample: dict[str, Any]) -> Layout:
    """The layout ``anyres_sample_fields`` stored in a sample (its tiles: the sample's pixel rows)."""
    return Layout(sample["image_feature_index"], sample["pixel_values"].shape[0], sample.get("image_feature_weight"))
