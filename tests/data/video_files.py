"""Tiny real video files for the video tests, written with PyAV (FFmpeg) inside the test: never downloaded."""

from __future__ import annotations

import os

import av
import numpy as np


def frame_pixels(index: int, size: int) -> np.ndarray:
    """Frame ``index``: seeded noise, so two different frames never decode alike."""
    return np.random.default_rng(index).integers(0, 256, (size, size, 3), dtype=np.uint8)


def write_video(
    path, frames: int, size: int = 32, rate: int = 10, codec: str = "libx264", fmt: str | None = None,
    gop: int = 5, options: dict | None = None,
) -> str:  # fmt: skip
    """``frames`` frames of ``size`` × ``size`` at ``rate`` frames/s, a key frame at least every ``gop`` frames."""
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    with av.open(str(path), "w", format=fmt, options=options or {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        if frames == 0:
            container.start_encoding()
        for i in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame_pixels(i, size), format="rgb24")))
        container.mux(stream.encode())
    return str(path)


def write_audio(path) -> str:
    """An audio-only mp4 (AAC, a fifth of a second of silence)."""
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        for i in range(3):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return str(path)


def reference_decode(path, indices: list[int]) -> list[np.ndarray]:
    """PyAV's plain loop: decode every frame in order, keep the ones at ``indices`` (as RGB arrays)."""
    wanted = set(indices)
    kept = {}
    with av.open(str(path)) as container:
        for i, frame in enumerate(container.decode(container.streams.video[0])):
            if i in wanted:
                kept[i] = np.asarray(frame.to_image())
    return [kept[i] for i in indices]
