"""The built-in synthetic video task: deterministic per seed, every answer read back from the decoded frames by an
independent rule, a first frame (what one-frame sampling takes) that does not determine the motion, and trainable
through the data module."""

from __future__ import annotations

import dataclasses

import numpy as np

from neva.data.config import DataConfig
from neva.data.datamodule import NevaDataModule
from neva.data.synthetic import COLORS
from neva.data.synthetic_video import FRAMES, Clip, video_records, write_videos
from neva.models.presets import build_config
from neva.models.video import VideoConfig
from tests.data.video_files import reference_decode

AXES = {"left": (0, -1), "right": (0, 1), "top": (1, -1), "bottom": (1, 1)}  # (axis of (x, y), sign)


def read_shape(frame: np.ndarray) -> tuple[np.ndarray, str]:
    """Centroid (x, y) of the coloured pixels (the background is grey) and their nearest palette colour."""
    px = frame.astype(int)
    mask = px.max(-1) - px.min(-1) > 60
    ys, xs = np.nonzero(mask)
    rgb = np.median(px[mask], axis=0)
    color = min(COLORS, key=lambda name: np.abs(np.array(COLORS[name]) - rgb).sum())
    return np.array([xs.mean(), ys.mean()]), color


def expected_answer(question: str, frames: list[np.ndarray]) -> str:
    (start, first_color), (end, last_color) = read_shape(frames[0]), read_shape(frames[-1])
    if question.startswith("Which side"):
        move = end - start
        axis = int(np.argmax(np.abs(move)))
        assert abs(move[axis]) >= 12 and abs(move[1 - axis]) < 2  # first and last frame differ: centre to an edge
        return {(a, s): name for name, (a, s) in AXES.items()}[(axis, int(np.sign(move[axis])))]
    assert first_color != last_color
    return last_color if question == "What color is it at the end?" else first_color


def test_clips_are_deterministic_per_seed(tmp_path):
    records = video_records(0, "train", 3, "qa")
    assert records == video_records(0, "train", 3, "qa") != video_records(1, "train", 3, "qa")
    for d in ("a", "b"):
        write_videos(0, records, str(tmp_path / d))
    for r in records:
        a, b = (reference_decode(tmp_path / d / r["video"], list(range(FRAMES))) for d in ("a", "b"))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_every_answer_follows_from_the_frames(tmp_path):
    records = video_records(3, "val", 12, "qa")  # every question kind four times
    write_videos(3, records, str(tmp_path))
    for r in records:
        human, gpt = r["conversations"]
        frames = reference_decode(tmp_path / r["video"], list(range(FRAMES)))
        assert expected_answer(human["value"].split("\n", 1)[1], frames) == gpt["value"], r["id"]


def test_the_first_frame_does_not_determine_the_motion():
    # num_frames=1 samples frame 0 (np.linspace(0, FRAMES - 1, 1)): the shape where it starts, whichever way it goes
    clips = [Clip("square", d, "red", "blue", start=(5, -3), background=20) for d in AXES]
    first = [np.asarray(c.frame(0)) for c in clips]
    assert all(np.array_equal(first[0], f) for f in first[1:])
    assert len({np.asarray(c.frame(FRAMES - 1)).tobytes() for c in clips}) == len(AXES)


def test_the_data_module_trains_on_the_clips(tmp_path, synthetic_tokenizer):
    cfg = dataclasses.replace(build_config(image_token_id=4), video=VideoConfig())
    data = DataConfig(
        data_path="synthetic_video", video_folder=str(tmp_path), synthetic_train_samples=4, synthetic_val_samples=2,
        num_frames=4, media_type="video",
    )  # fmt: skip
    dm = NevaDataModule(data, synthetic_tokenizer, cfg, micro_batch_size=2, seed=0)
    batch = next(iter(dm.train_dataloader()))
    assert batch.counts.num_samples == 2 and batch.media.video.frames.tolist() == [4, 4]
    assert batch.media.video.positions.shape[0] == 2 * cfg.video_tokens(4)
    assert sum(b.counts.num_samples for b in dm.val_dataloader()) == 2
