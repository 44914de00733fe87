"""Video decoding: sampled indices by LLaVA-NeXT-Video's rules and pixels equal to PyAV's plain decode-all loop,
a seek that decodes only part of the file, and every bad-input class named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from neva.data.video_decode import VideoError, VideoLimits, decode_video
from tests.data.video_files import reference_decode, write_audio, write_video


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return {
        "mp4": write_video(d / "a.mp4", 30),
        "webm": write_video(d / "a.webm", 30, codec="libvpx-vp9"),  # no frame count in the header: packets counted
        "long": write_video(d / "long.mp4", 120, gop=10),
        "one_gop": write_video(d / "one_gop.mp4", 30, gop=60),  # one key frame: seeking cannot help
    }


def _same_pixels(video, path):
    expected = reference_decode(path, video.indices)
    assert all(np.array_equal(np.asarray(got), want) for got, want in zip(video.frames, expected))


@pytest.mark.parametrize(
    ("kind", "limits", "indices"),
    [
        ("mp4", VideoLimits(8), np.linspace(0, 29, 8, dtype=int).tolist()),
        ("webm", VideoLimits(8), np.linspace(0, 29, 8, dtype=int).tolist()),
        ("mp4", VideoLimits(40), np.linspace(0, 29, 40, dtype=int).tolist()),  # short video: frames repeat
        ("mp4", VideoLimits(8, fps=2.0), [0, 5, 10, 15, 20, 25]),  # 10 frames/s, one frame every 0.5 s
        ("webm", VideoLimits(4, fps=2.0), np.linspace(0, 29, 4, dtype=int).tolist()),  # 6 > 4: the uniform rule
    ],
)
def test_sampled_frames_equal_the_plain_decode_loop(clips, kind, limits, indices):
    video = decode_video(clips[kind], kind, limits)
    assert video.indices == indices
    assert len(video.frames) == len(indices)
    _same_pixels(video, clips[kind])


def test_late_frames_are_reached_by_seeking(clips):
    video = decode_video(clips["long"], "long", VideoLimits(3))
    assert video.indices == [0, 59, 119]
    _same_pixels(video, clips["long"])
    assert video.decoded < 40  # key frames every 10 frames: three short decodes, not 120 frames
    video = decode_video(clips["one_gop"], "one_gop", VideoLimits(8))
    _same_pixels(video, clips["one_gop"])
    assert video.decoded <= 31  # a seek tried once at most, not one back to frame 0 per sampled frame


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    full = Path(write_video(d / "fs.mp4", 40, options={"movflags": "faststart"})).read_bytes()
    (d / "cut.mp4").write_bytes(full[: int(len(full) * 0.8)])  # index up front, frames cut: ends early
    plain = Path(write_video(d / "plain.mp4", 20)).read_bytes()
    (d / "headless.mp4").write_bytes(plain[: len(plain) // 2])  # cut before its index: unreadable
    (d / "garbage.mp4").write_bytes(b"not a video " * 50)
    from PIL import Image

    Image.new("RGB", (16, 16), "red").save(d / "still.mp4", format="PNG")  # a picture named .mp4
    return {
        "truncated_video": str(d / "cut.mp4"),
        "corrupt_video": str(d / "headless.mp4"),
        "garbage": str(d / "garbage.mp4"),
        "empty_video": write_video(d / "empty.avi", 0, codec="mpeg4", fmt="avi"),
        "not_a_video": write_audio(d / "audio.mp4"),
        "still_image": str(d / "still.mp4"),
        "one_frame": write_video(d / "one.mp4", 1),
        "big": write_video(d / "big.mp4", 4, size=64),
        "long": write_video(d / "long.mp4", 30, rate=10),
    }


@pytest.mark.parametrize(
    ("name", "limits", "reason"),
    [
        ("truncated_video", VideoLimits(8), "truncated_video"),
        ("corrupt_video", VideoLimits(8), "corrupt_video"),
        ("garbage", VideoLimits(8), "corrupt_video"),
        ("empty_video", VideoLimits(8), "empty_video"),
        ("not_a_video", VideoLimits(8), "not_a_video"),
        ("still_image", VideoLimits(8), "still_image"),
        ("one_frame", VideoLimits(8), "still_image"),
        ("big", VideoLimits(8, max_frame_pixels=32 * 32), "video_too_large"),
        ("long", VideoLimits(8, max_seconds=2.0), "video_too_long"),
    ],
)
def test_bad_input_is_named(bad, name, limits, reason):
    with pytest.raises(VideoError) as exc:
        decode_video(bad[name], name, limits)
    assert exc.value.reason == reason


def test_one_frame_is_a_video_when_one_frame_is_asked(bad):
    assert decode_video(bad["one_frame"], "one", VideoLimits(1)).indices == [0]
