"""Video file → sampled RGB frames, with PyAV (FFmpeg), in the loader workers: seek, bounded, bad input named.

Sampling (``VideoLimits``), on the stream's ``total`` frames (the header's count, else its packets counted by a
demux pass that decodes nothing):

* uniform (``video_fps`` None): ``np.linspace(0, total - 1, num_frames, dtype=int)``, LLaVA-NeXT-Video's
  ``load_video`` and transformers' ``sample_indices_fn`` of the LLaVA-Video processors. A video shorter than
  ``num_frames`` repeats frames, so a video always gives ``num_frames`` frames in this mode.
* fps (``video_fps`` set): one frame every ``round(average_rate / video_fps)`` frames from frame 0 (LLaVA-NeXT's
  ``frame_idx = range(0, total, round(avg_fps / video_fps))``); more than ``num_frames`` of them → the uniform rule
  (LLaVA-NeXT's ``frames_upbound``). The frame count then follows from the header, before any frame is decoded.

Frame ``i`` is the frame presented at ``start + i / average_rate`` (its ``pts`` maps to ``i``): the decode order
index of decord and of a plain decode loop for constant-rate streams. To reach a frame far ahead the decoder seeks
(to the key frame at or before it) and decodes forward from there; near frames are decoded through (``_Seeker``: a
seek when a key frame is due before the target, by the key-frame distance seen so far). Only kept frames are
converted to RGB (``VideoFrame.to_image``, FFmpeg's swscale, the same call a plain PyAV loop makes).

Refused before decoding, from the file size and the header: more than ``max_bytes`` (``video_too_large``), longer
than ``max_seconds`` (``video_too_long``), frames of more than ``max_frame_pixels`` (``video_too_large``), no video
stream (``not_a_video``: audio only), no frames (``empty_video``), a single frame
(``still_image``: a picture saved as .mp4; accepted when ``num_frames`` is 1). While decoding: FFmpeg errors
(``corrupt_video``), a stream that ends before a frame the header promised (``truncated_video``) and a decode that
runs past its frame or wall-clock budget (``video_decode_timeout``; checked between frames, so a file bounded in size
cannot hold a worker). A file FFmpeg cannot open at all (garbage, an mp4 cut before its index) is ``corrupt_video``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, BinaryIO

import av
import numpy as np
from PIL import Image

from neva.data.errors import SampleError

MAX_VIDEO_BYTES = 2 * 1024**3
MAX_VIDEO_SECONDS = 3600.0
MAX_FRAME_PIXELS = 7680 * 4320  # 8K UHD: larger frames are not a video a tower can use
DECODE_SECONDS = 120.0  # wall-clock budget of one video's decode (a healthy one takes well under a second)


class VideoError(SampleError):
    """A video that cannot be used."""


@dataclass(frozen=True)
class VideoLimits:
    """How frames are sampled (``num_frames``, ``fps``) and what a file may be (``model.data`` video keys)."""

    num_frames: int = 8
    fps: float | None = None
    max_bytes: int = MAX_VIDEO_BYTES
    max_seconds: float = MAX_VIDEO_SECONDS
    max_frame_pixels: int = MAX_FRAME_PIXELS
    decode_seconds: float = DECODE_SECONDS

    def __post_init__(self) -> None:
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"video_fps must be > 0, got {self.fps}")


def uniform_indices(total: int, num_frames: int) -> list[int]:
    """LLaVA-NeXT-Video's ``np.linspace(0, total - 1, num_frames, dtype=int)`` (repeats when ``total`` is short)."""
    return np.linspace(0, total - 1, num_frames, dtype=int).tolist()


def sample_indices(total: int, rate: float, limits: VideoLimits) -> list[int]:
    """The frame indices a video of ``total`` frames at ``rate`` frames/s gives (module docstring)."""
    if limits.fps is None:
        return uniform_indices(total, limits.num_frames)
    step = max(1, round(rate / limits.fps))
    indices = list(range(0, total, step))
    return indices if len(indices) <= limits.num_frames else uniform_indices(total, limits.num_frames)


@dataclass(frozen=True)
class VideoHeader:
    """What the container says before any frame is decoded."""

    total: int
    rate: float
    width: int
    height: int
    seconds: float | None


@dataclass(frozen=True)
class DecodedVideo:
    """Sampled frames (RGB, time order), the indices they are and how many frames were decoded to get them."""

    frames: list[Image.Image]
    indices: list[int]
    header: VideoHeader
    decoded: int


def open_container(file: BinaryIO | str, name: str) -> Any:
    """``av.open`` for reading; a file FFmpeg cannot demux (truncated before its index, garbage) is ``corrupt_video``."""
    try:
        return av.open(file, "r")
    except av.FFmpegError as exc:
        raise VideoError("corrupt_video", f"{name}: {type(exc).__name__}: {exc}") from exc


def read_header(container: Any, name: str, limits: VideoLimits) -> tuple[Any, VideoHeader]:
    """The first video stream and its header, checked against ``limits``.

    Raises:
        VideoError: ``not_a_video``, ``video_too_large``, ``video_too_long``, ``empty_video``, ``still_image`` or
            ``corrupt_video``.
    """
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise VideoError("not_a_video", f"{name}: no video stream (streams: {', '.join(kinds)})")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    width, height = int(ctx.width or 0), int(ctx.height or 0)
    if width * height > limits.max_frame_pixels:
        raise VideoError(
            "video_too_large",
            f"{name}: {width}x{height} frames = {width * height:,} pixels > max_video_frame_pixels "
            f"{limits.max_frame_pixels:,}",
        )
    seconds = _seconds(container, stream)
    if seconds is not None and seconds > limits.max_seconds:
        raise VideoError("video_too_long", f"{name}: {seconds:.1f} s > max_video_seconds {limits.max_seconds:g}")
    rate = float(stream.average_rate or stream.guessed_rate or 0) or 1.0
    total = int(stream.frames or 0) or _count_packets(container, stream, name)
    if total == 0:
        raise VideoError("empty_video", f"{name}: the video stream has no frames")
    if total == 1 and limits.num_frames > 1:
        raise VideoError("still_image", f"{name}: one frame (a still image), num_frames {limits.num_frames}")
    return stream, VideoHeader(total, rate, width, height, seconds)


def _seconds(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _count_packets(container: Any, stream: Any, name: str) -> int:
    """Frames of a stream whose header has no count (webm, raw streams): its non-empty packets, nothing decoded."""
    n = 0
    try:
        for packet in container.demux(stream):
            n += 1 if packet.size else 0
        if n:
            container.seek(0)  # a stream without timestamps (raw H.264) cannot seek: corrupt_video
    except av.FFmpegError as exc:
        raise VideoError("corrupt_video", f"{name}: {type(exc).__name__}: {exc}") from exc
    return n


class _Timeline:
    """Frame index ↔ pts for a constant-rate stream (``start + i / rate``)."""

    def __init__(self, stream: Any, rate: float) -> None:
        self.start = stream.start_time or 0
        self.ticks = 1.0 / (rate * float(stream.time_base))  # pts units per frame

    def index(self, pts: int) -> int:
        return round((pts - self.start) / self.ticks)

    def pts(self, index: int) -> int:
        return self.start + math.floor(index * self.ticks)


class _Seeker:
    """When a seek pays: when a key frame lies between the current frame and the target (a seek lands on the key
    frame at or before the target; one at or before the current frame re-decodes frames already passed).

    Key frames are watched while decoding: ``interval`` is the longest distance between two key frames of one run
    of consecutive frames. Known, a seek pays when the next key frame is due at or before the target. Unknown (one
    long group of pictures so far), a seek is tried when the frames it may save exceed those it may waste (the run
    since the last key frame), so a failed try at most doubles the work of that gap.
    """

    def __init__(self) -> None:
        self.last_key: int | None = None
        self.interval: int | None = None
        self.after_seek = True

    def pays(self, current: int, target: int) -> bool:
        if self.last_key is None:
            return True
        run = current - self.last_key + 1
        if self.interval is None:
            return target - current > run
        return self.last_key + max(self.interval, run) <= target

    def saw(self, index: int, key: bool) -> None:
        if key:
            if not self.after_seek and self.last_key is not None:
                self.interval = max(self.interval or 0, index - self.last_key)
            self.last_key = index
        self.after_seek = False


def decode_indices(
    container: Any, stream: Any, header: VideoHeader, indices: list[int], name: str, limits: VideoLimits
) -> tuple[list[Image.Image], int]:
    """The frames at ``indices`` (any order, repeats allowed), RGB, in the order asked, and the frames decoded.

    Raises:
        VideoError: ``corrupt_video``, ``truncated_video`` or ``video_decode_timeout``.
    """
    stream.codec_context.thread_count = 1  # one loader worker = one core: workers are the parallelism
    timeline = _Timeline(stream, header.rate)
    wanted = sorted(set(indices))
    got: dict[int, Image.Image] = {}
    # Frames decoded, a seek's re-decode included: each seek re-decodes at most one key-frame interval.
    budget = (len(wanted) + 1) * header.total + 64
    start = time.monotonic()
    decoded, current = 0, -1
    seeker = _Seeker()
    frames, heading = None, -1
    try:
        k = 0
        while k < len(wanted):
            target = wanted[k]
            if frames is None or (target != heading and seeker.pays(current, target)):  # once per target
                container.seek(timeline.pts(target), stream=stream, backward=True, any_frame=False)
                frames, seeker.after_seek = container.decode(stream), True
            heading = target
            frame = next(frames, None)
            if frame is None:  # end of stream
                break
            decoded += 1
            elapsed = time.monotonic() - start
            if decoded > budget or elapsed > limits.decode_seconds:
                raise VideoError(
                    "video_decode_timeout",
                    f"{name}: {decoded} frames decoded in {elapsed:.1f} s without reaching frame {target} of "
                    f"{header.total} (budget {budget} frames, {limits.decode_seconds:g} s)",
                )
            current = timeline.index(frame.pts) if frame.pts is not None else current + 1
            seeker.saw(current, frame.key_frame)
            while k < len(wanted) and wanted[k] <= current:  # a missing index takes the next frame presented
                got[wanted[k]] = frame.to_image()
                k += 1
    except av.FFmpegError as exc:
        raise VideoError("corrupt_video", f"{name}: {type(exc).__name__}: {exc}") from exc
    missing = [i for i in wanted if i not in got]
    if missing:
        raise VideoError(
            "truncated_video", f"{name}: the stream ends at frame {current} before frame {missing[0]} of {header.total}"
        )
    return [got[i] for i in indices], decoded


def decode_video(file: BinaryIO | str, name: str, limits: VideoLimits) -> DecodedVideo:
    """Open, check the header, sample indices, decode them (module docstring). Raises ``VideoError``."""
    container = open_container(file, name)
    try:
        stream, header = read_header(container, name, limits)
        indices = sample_indices(header.total, header.rate, limits)
        frames, decoded = decode_indices(container, stream, header, indices, name, limits)
        return DecodedVideo(frames, indices, header, decoded)
    finally:
        container.close()
