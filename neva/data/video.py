"""Video records: where a record's videos are, which placeholders they fill, and their frames as tower inputs.

Formats (mixed freely with image and text-only records):

* NeMo Video-NeVA / LLaVA-Video style: ``"video": "clip.mp4"`` (or a list), a ``<video>`` placeholder per video in
  the human turns.
* LLaVA-NeXT-Video's own data (LLaVA-Video-178K): ``"video"`` with ``<image>`` placeholders and no ``"image"`` key;
  then the ``<image>`` tags are the videos' (their count must equal the videos').
* No placeholder at all: ``<video>\\n`` is put in front of the first human turn, once per video.

Each placeholder becomes one ``<image>`` tag for the encoder (so tokenization, placement and the rule that a
placeholder never sits in a reply are the image rules) with the video's own positions, ``cfg.video_tokens(frames)``
(``neva.models.video``); the tags are told apart by their order (``tag_kinds``). Frames are fit to the tower exactly
as an image with ``image_aspect_ratio: square`` is (its family's ``TowerSpec.fit``), as LLaVA-NeXT-Video's processor does
for frames whatever the image setting.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from neva.constants import IMAGE_TOKEN, VIDEO_TOKEN
from neva.data.images import ImageError, ImageProcessor, open_regular_file, resolve_in_folder
from neva.data.templates.base import USER, ConversationError, Message
from neva.data.video_decode import DecodedVideo, VideoError, VideoLimits, decode_video
from neva.models.config import VisionConfig

IMAGE, VIDEO = "image", "video"
_TAGS = re.compile(f"{re.escape(IMAGE_TOKEN)}|{re.escape(VIDEO_TOKEN)}")


def as_video_error(exc: ImageError) -> VideoError:
    """The image path rules' errors, named for a video (``unsafe_video_path``, ``missing_video``...)."""
    detail = exc.detail.replace("image path", "video path").replace("image folder", "video folder")
    return VideoError(exc.reason.replace("image", "video"), detail)


def tag_kinds(messages: list[Message], num_images: int, num_videos: int) -> tuple[list[Message], list[str]]:
    """Messages with every video placeholder as an ``<image>`` tag, and the kind of each tag in text order.

    Raises:
        ConversationError: ``video_count_mismatch`` (placeholders and videos differ in number).
    """
    placeholders = sum(m.content.count(VIDEO_TOKEN) for m in messages)
    if num_videos == 0 and placeholders == 0:
        return messages, [IMAGE] * sum(m.content.count(IMAGE_TOKEN) for m in messages)
    images = sum(m.content.count(IMAGE_TOKEN) for m in messages)
    if placeholders == 0 and num_images == 0 and images == num_videos:
        return messages, [VIDEO] * num_videos  # LLaVA-NeXT-Video's data: <image> tags name the videos
    if placeholders == 0:  # num_videos > 0
        first = next((i for i, m in enumerate(messages) if m.role == USER), None)
        if first is None:
            raise ConversationError("video_count_mismatch", f"no human turn for {num_videos} video(s)")
        messages = list(messages)
        m = messages[first]
        messages[first] = Message(m.role, (VIDEO_TOKEN + "\n") * num_videos + m.content)
        placeholders = num_videos
    if placeholders != num_videos:
        raise ConversationError("video_count_mismatch", f"{placeholders} {VIDEO_TOKEN} tags for {num_videos} videos")
    kinds = [IMAGE if tag == IMAGE_TOKEN else VIDEO for m in messages for tag in _TAGS.findall(m.content)]
    out = [Message(m.role, m.content.replace(VIDEO_TOKEN, IMAGE_TOKEN)) for m in messages]
    return out, kinds


def check_video_bytes(size: int, name: Any, limits: VideoLimits) -> None:
    """Raises ``video_too_large`` for a file of more than ``max_video_bytes`` (its size, before any byte is read)."""
    if size > limits.max_bytes:
        raise VideoError("video_too_large", f"{name}: {size:,} bytes > max_video_bytes {limits.max_bytes:,}")


class VideoSource:
    """Videos under a folder (the image folder's path rules: no absolute path, no escape, regular files only).

    Args:
        root: the video folder (None: any record with a video is skipped as ``missing_video``).
        limits: sampling and caps.
        vision: the tower frames are fit to (its family's ``fit``, ``image_aspect_ratio: square``); None: frames are
            decoded but not made tower inputs (``neva.data.preview``).
    """

    def __init__(self, root: str | None, limits: VideoLimits, vision: VisionConfig | None = None) -> None:
        self.root = os.path.realpath(root) if root is not None else None
        self.limits = limits
        self.processor = ImageProcessor(vision, "square") if vision is not None else None

    def load(self, name: Any) -> DecodedVideo:
        """The sampled frames of the video called ``name``. Raises ``VideoError``."""
        try:
            if self.root is None:
                raise ImageError("missing_image", f"{name!r}: no model.data.video_folder (or image_folder) configured")
            path = resolve_in_folder(self.root, name)
            with open_regular_file(path, name, f" in {self.root}") as f:
                check_video_bytes(os.fstat(f.fileno()).st_size, name, self.limits)
                return decode_video(f, name, self.limits)
        except ImageError as exc:
            raise as_video_error(exc) from exc

    def pixels(self, video: DecodedVideo) -> torch.Tensor:
        """A video's frames as tower inputs, uint8 ``[F, 3, s, s]``."""
        if self.processor is None:
            raise ValueError("this VideoSource has no vision tower")
        return torch.stack([self.processor(frame) for frame in video.frames])


def read_video_file(path: str | os.PathLike, limits: VideoLimits) -> np.ndarray:
    """A video file's sampled frames as uint8 ``[F, H, W, 3]`` RGB (what ``neva.inference`` items take), decoded by the
    loader's decoder under the loader's caps (the file's own folder as the video folder).

    Raises:
        VideoError: the reasons a training sample with this video would be skipped for.
    """
    path = os.path.realpath(path)
    video = VideoSource(os.path.dirname(path), limits).load(os.path.basename(path))
    return np.stack([np.asarray(frame.convert("RGB")) for frame in video.frames])


def check_video_model(names: list[Any], settings: Any) -> None:
    """Raises ``video_unsupported`` when a record has videos and the model takes none."""
    if names and settings.video_tokens is None:
        raise VideoError("video_unsupported", f"{len(names)} video(s); the model takes no video (model.video unset)")


def tag_spans(input_ids: list[int], image_token_id: int, tags: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """``(kind, start, end)`` of every visual tag's positions in encoded ids (``encode_media_record``'s tags)."""
    spans, pos = [], 0
    for kind, n in tags:
        pos = input_ids.index(image_token_id, pos)
        spans.append((kind, pos, pos + n))
        pos += n
    return spans


def load_videos(names: list[Any], settings: Any, source: VideoSource | None) -> list[DecodedVideo]:
    """A record's videos, decoded (``settings``: the dataset's ``EncoderSettings``).

    Raises:
        VideoError: ``video_unsupported`` (the model takes no video), ``missing_video`` (no video folder) or the
            video's own reason.
    """
    if not names:
        return []
    check_video_model(names, settings)
    if source is None:
        raise VideoError("missing_video", f"{names[0]!r}: no model.data.video_folder (or image_folder) configured")
    return [source.load(name) for name in names]


def video_sample_fields(
    videos: list[DecodedVideo], source: VideoSource, tag_positions: torch.Tensor, tags: list[tuple[str, int]]
) -> dict[str, torch.Tensor]:
    """A sample's video keys (``video_pixel_values`` ``[F, 3, s, s]`` uint8, ``video_frames`` ``[V]``,
    ``video_positions`` ``[M_v]``) and its ``image_positions`` without the videos' (``tag_positions``: every visual
    tag's positions in order, ``tags``: each tag's kind and positions)."""
    pieces = torch.split(tag_positions, [n for _, n in tags])
    empty = tag_positions[:0]
    return {
        "image_positions": torch.cat([empty, *(p for p, (kind, _) in zip(pieces, tags) if kind == IMAGE)]),
        "video_positions": torch.cat([empty, *(p for p, (kind, _) in zip(pieces, tags) if kind == VIDEO)]),
        "video_pixel_values": torch.cat([source.pixels(v) for v in videos]),
        "video_frames": torch.tensor([len(v.frames) for v in videos], dtype=torch.long),
    }
