"""One vision front end per model, chosen once from the model config: how a record's images become tower inputs,
how many decoder positions each takes, and which sample fields lay their features out.

``FixedImages``: one tower input per image at the tower's resolution, the model's fixed count each (LLaVA-1.5).
``TiledImages``: LLaVA-NeXT's AnyRes: an image's tiles, its count from its size, its feature index as sample fields
(``neva.models.anyres``). ``NativeImages``: a native-resolution tower (Qwen-VL): each image's own patch grid under
the pixel budget, its count from its size, the grid and the sample's M-RoPE positions as sample fields. A tower's
family names its front end's factory (``TowerSpec.front_end``); the dataset calls ``encode`` and ``record_tokens``
and nothing else.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from neva.data.anyres import AnyResProcessor, anyres_sample_fields
from neva.data.errors import SampleError
from neva.data.images import ImageError, ImageProcessor, ImageSource, safe_relative_path
from neva.data.qwen_images import (
    QwenImageSpec,
    image_grid,
    image_patches,
    image_token_count,
    native_video_estimate,
    video_patches,
    video_second_per_grid,
)
from neva.data.records import record_images
from neva.data.video import VIDEO, tag_spans
from neva.data.video_decode import VideoError
from neva.families import part
from neva.models.anyres import anyres_on
from neva.models.mrope import HF_TOKENS_PER_SECOND, mrope_positions


@dataclass
class EncodedImages:
    """A record encoded with its images: the encoding, its media tags, the tower inputs, the image count and the
    sample fields the layout needs."""

    encoding: Any
    tags: list
    pixels: torch.Tensor
    images: int
    fields: dict[str, Any] = field(default_factory=dict)


class FrontEnd(Protocol):
    size: int
    processor: ImageProcessor | AnyResProcessor
    # An image's decoder positions where every image takes the same count (after the projector); 0 where each image
    # is counted from its size.
    image_tokens: int
    # Whether the front end makes a record's videos its own tower inputs (``encode``'s ``videos``), and then a
    # video's positions from its frames (``video_tokens(frames)``); else videos are the dataset's pooled frames.
    reads_videos: bool

    def encode(
        self, record: dict[str, Any], encode: Any, image_source: ImageSource, videos: list[Any] = ()
    ) -> EncodedImages:
        """``encode(per_image_tokens, per_video_tokens=None)`` encodes the record's text (None: the fixed count per
        image; the settings' count per video). ``videos``: the record's decoded videos (``DecodedVideo``), which
        only a front end that makes them its own tower inputs reads (``NativeImages``; the others' videos are the
        dataset's ``video_sample_fields``)."""
        ...

    def record_tokens(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        """A record's image positions from its images' headers, or None where the count is the fixed rule's."""
        ...

    def record_patches(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        """A record's tower patches from its images' headers where they vary with image size (native resolution),
        else None (a fixed-size tower: every image the same work)."""
        ...


class FixedImages:
    """One tower input per image; the text is encoded first (its tags say which images, in which order)."""

    reads_videos = False

    # ``image_tokens``: the count the data module encodes with (``front_end_for``); a dataset built by hand takes its
    # settings' own and leaves it 0.
    def __init__(self, processor: ImageProcessor, image_tokens: int = 0) -> None:
        self.processor = processor
        self.size = processor.size
        self.image_tokens = image_tokens

    def encode(
        self, record: dict[str, Any], encode: Any, image_source: ImageSource, videos: list[Any] = ()
    ) -> EncodedImages:
        enc, names, tags = encode(None)
        pixels = [self.processor(image_source.load(name)) for name in names]
        return EncodedImages(enc, tags, _stack(pixels, self.size), len(pixels))

    def record_tokens(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        return None

    def record_patches(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        return None


class TiledImages:
    """AnyRes: an image's positions follow from its size, so the images are decoded before the text is encoded
    (their count checks and paths are then checked by the decode, before the conversation's)."""

    reads_videos = False

    def __init__(self, processor: AnyResProcessor, image_tokens: int = 0) -> None:
        self.processor = processor
        self.size = processor.size
        self.image_tokens = image_tokens  # a tile's (the data's encoder counts an image from its layout)

    def encode(
        self, record: dict[str, Any], encode: Any, image_source: ImageSource, videos: list[Any] = ()
    ) -> EncodedImages:
        loaded = [image_source.load(safe_relative_path(name)) for name in record_images(record)]
        layouts = self.processor.layouts(loaded)
        enc, _, tags = encode([lay.tokens for lay in layouts])
        pixels = self.processor.tiles(loaded) if loaded else _stack([], self.size)
        # each image's layout size rides along: generation (the online RL stage's rollouts) lays a prompt's images out
        # from their sizes, as serving does
        fields = {
            **anyres_sample_fields(layouts, self.processor.tile_tokens),
            "image_sizes": self.processor.sizes(loaded),
        }
        return EncodedImages(enc, tags, pixels, len(loaded), fields)

    def record_tokens(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        try:
            sizes = [image_source.size(safe_relative_path(name)) for name in record_images(record)]
        except SampleError:
            return None  # the sample is skipped (and counted) when it is read; its length here is a guess
        return self.processor.tokens(sizes)

    def record_patches(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        return None  # a tile is one fixed-size tower pass: the token lengths already weigh the tower's work


class NativeImages:
    """Native resolution (Qwen2-VL / Qwen2.5-VL / Qwen3-VL): each image resized to its own patch grid within
    ``min_pixels`` / ``max_pixels`` (``neva.data.qwen_images``), taking t·h·w / merge² positions; the images are
    decoded before the text is encoded (their counts follow from their sizes). The sample carries each image's grid
    (``image_grid``, the tower's and the splice's) and its ``[3, S]`` M-RoPE positions (``neva.models.mrope``), found
    here per sample so that a packed row holds each sample's own. A model that takes video (``patch_video``) has a
    record's decoded videos as temporal patches (``video_patches``: frames at the image budget, grouped
    ``temporal_patch_size`` at a time), each ``<video>`` tag's positions given the video token, a ``video_grid`` per
    video and, for Qwen2.5-VL, the videos' ``second_per_grid_ts`` in the positions."""

    size = 0
    image_tokens = 0
    reads_videos = True

    def __init__(self, model: Any, min_pixels: int | None = None, max_pixels: int | None = None) -> None:
        self.processor = QwenImageSpec.for_tower(model.vision, min_pixels, max_pixels)
        self.family = model.vision.kind
        self.video_rule = model.vision.spec.video
        self.image_token_id = model.image_token_id
        # A token no sample holds where the model takes no video: the rule then places images only.
        self.video_token_id = model.video_token_id if model.patch_video else -1
        self.tokens_per_second = model.vision.tokens_per_second
        if self.tokens_per_second is None:
            self.tokens_per_second = HF_TOKENS_PER_SECOND
        self.empty = torch.zeros(0, model.vision.patch_dim, dtype=torch.uint8)

    def with_max_pixels(self, max_pixels: int) -> NativeImages:
        """This front end under a lower pixel budget (``neva.data.visual_budget``'s downscale)."""
        scaled = copy.copy(self)
        scaled.processor = dataclasses.replace(self.processor, max_pixels=max_pixels)
        return scaled

    def encode(
        self, record: dict[str, Any], encode: Any, image_source: ImageSource, videos: list[Any] = ()
    ) -> EncodedImages:
        spec = self.processor
        processed = [image_patches(image_source.load(safe_relative_path(n)), spec) for n in record_images(record)]
        grid = torch.cat([g for _, g in processed]) if processed else torch.zeros(0, 3, dtype=torch.long)
        clips = self._videos(videos)
        video_grid = torch.cat([g for _, g in clips]) if clips else torch.zeros(0, 3, dtype=torch.long)
        enc, _, tags = encode(
            [int(g.prod()) // spec.merge_size**2 for g in grid],
            [int(g.prod()) // spec.merge_size**2 for g in video_grid],
        )
        fields: dict[str, Any] = {"image_grid": grid}
        if clips:  # the video tags' positions carry the video token (each tag was encoded as an image's)
            enc, video_fields = self._video_fields(enc, tags, clips, video_grid, videos)
            fields.update(video_fields)
        positions, _ = mrope_positions(
            torch.tensor(enc.input_ids),
            grid,
            video_grid if clips else None,
            spatial_merge_size=spec.merge_size,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            family=self.family,
            second_per_grid_ts=fields.pop("second_per_grid_ts", None),
            tokens_per_second=self.tokens_per_second,
        )
        pixels = torch.cat([p for p, _ in processed]) if processed else self.empty
        return EncodedImages(enc, tags, pixels, len(processed), {**fields, "position_ids": positions})

    def video_tokens(self, frames: int) -> int:
        """A video's positions estimated from its frame count before it is decoded (``native_video_estimate``)."""
        return native_video_estimate(self.processor, frames)

    def _videos(self, videos: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if videos and not (self.video_rule is not None and self.video_rule.served):
            raise VideoError(
                "video_unsupported",
                f"{len(videos)} video(s): {self.family} video (per-frame timestamp text) is not implemented yet",
            )
        return [video_patches(v.frames, self.processor) for v in videos]

    def _video_fields(self, enc: Any, tags: list, clips: list, video_grid: torch.Tensor, videos: list) -> tuple:
        ids = torch.tensor(enc.input_ids)
        spans = tag_spans(enc.input_ids, self.image_token_id, tags)
        at = torch.cat([torch.arange(a, b) for kind, a, b in spans if kind == VIDEO])
        ids[at] = self.video_token_id
        enc = dataclasses.replace(enc, input_ids=ids.tolist())
        fields = {
            "video_pixel_values": torch.cat([p for p, _ in clips]),
            "video_grid": video_grid,
            "video_frames": torch.tensor([len(v.frames) for v in videos], dtype=torch.long),
            "video_positions": at,
        }
        if self.video_rule.timed:  # Qwen2.5-VL: temporal positions in real time
            fields["second_per_grid_ts"] = [
                video_second_per_grid(self.processor, len(v.indices), v.header.total, v.header.rate) for v in videos
            ]
        return enc, fields

    def record_tokens(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        try:
            sizes = [image_source.size(safe_relative_path(name)) for name in record_images(record)]
        except SampleError:
            return None  # skipped (and counted) when read
        return sum(image_token_count(self.processor, h, w) for h, w in sizes)

    def record_patches(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        """The tower's patches (t·h·w per image, before the merger), 0 where a header cannot be read (the sample is
        skipped when read)."""
        try:
            sizes = [image_source.size(safe_relative_path(name)) for name in record_images(record)]
        except SampleError:
            return 0
        return sum(math.prod(image_grid(self.processor, h, w)) for h, w in sizes)


class NoImages:
    """A model without a vision tower: a record that names an image is a counted skip."""

    size = 0
    processor = None
    image_tokens = 0
    reads_videos = False

    def encode(
        self, record: dict[str, Any], encode: Any, image_source: ImageSource, videos: list[Any] = ()
    ) -> EncodedImages:
        enc, names, tags = encode(None)
        if names:
            raise ImageError("missing_image", "the model has no vision encoder")
        return EncodedImages(enc, tags, _stack([], 0), 0)

    def record_tokens(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        return None

    def record_patches(self, record: dict[str, Any], image_source: ImageSource) -> int | None:
        return None


def front_end_for(
    vision: Any, model: Any, image_aspect_ratio: str, min_pixels: int | None = None, max_pixels: int | None = None
) -> FrontEnd:
    """The front end of a model (``NevaConfig``, or None where only its ``vision`` tower config is known): the one its
    tower's family names (``TowerSpec.front_end``; a patch-grid tower's pixel budget ``min_pixels`` / ``max_pixels``,
    None: the family's), none without a tower."""
    if vision is None:
        return NoImages()
    return part(vision.spec.front_end)(vision, model, image_aspect_ratio, min_pixels, max_pixels)


def native_images(
    vision: Any, model: Any, image_aspect_ratio: str, min_pixels: int | None = None, max_pixels: int | None = None
) -> NativeImages:
    """A patch-grid tower's front end (the Qwen families'): each image at its own grid under the pixel budget."""
    return NativeImages(model, min_pixels, max_pixels)


def fixed_or_tiled(
    vision: Any, model: Any, image_aspect_ratio: str, min_pixels: int | None = None, max_pixels: int | None = None
) -> FixedImages | TiledImages:
    """A fixed-size tower's front end (CLIP's, SigLIP's): tiled where the model's AnyRes and the data's aspect ratio
    ask for it (``anyres_on``), fixed tiles at the tower's resolution otherwise."""
    pinpoints = getattr(getattr(model, "anyres", None), "grid_pinpoints", None)
    # After the projector (mlp_downsample merges 2×2 patches) when the model is known.
    tokens = vision.num_image_tokens if model is None else model.num_image_tokens
    if anyres_on(image_aspect_ratio, pinpoints):
        return TiledImages(AnyResProcessor(model), tokens)
    return FixedImages(ImageProcessor(vision, image_aspect_ratio), tokens)


def _stack(pixels: list[torch.Tensor], size: int) -> torch.Tensor:
    return torch.stack(pixels) if pixels else torch.zeros(0, 3, size, size, dtype=torch.uint8)
