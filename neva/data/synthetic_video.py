"""Built-in synthetic video task: a shape moving left / right / up / down while its colour changes, as real mp4 files.

A clip is ``FRAMES`` frames of ``SIZE`` × ``SIZE`` pixels at ``RATE`` frames/s (H.264, written with PyAV): one filled
shape (``neva.data.synthetic``'s shapes and palette) travels in a straight line across the frame, in its first colour
for the first half of the clip and its second colour for the rest. The questions need more than one frame:

- ``motion``: "Which way does the square move?" (left / right / up / down): one frame shows where the shape is, not
  where it goes.
- ``end_color``: "What color is it at the end?" and ``start_color``: "What color is it at the start?": every clip
  shows two colours, so one frame cannot tell which one a question asks for without knowing when it was taken.

Everything is a pure function of ``(seed, split, index)``: the records are cheap dicts in LLaVA-Video's format
(``"video"`` and a ``<video>`` placeholder); ``write_videos`` writes each record's file into the video folder once
(``model.data.video_folder``, else ``default_folder``), atomically, so ranks and workers that write at once agree.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
from PIL import Image, ImageDraw

from neva.constants import VIDEO_TOKEN
from neva.data.synthetic import COLORS, SHAPES, SPLITS, draw_shape

FRAMES = 16
SIZE = 64
RATE = 8
SHAPE_SIZE = 16
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
KINDS = ("motion", "end_color", "start_color")
QUESTIONS = {
    "motion": "Which way does the {shape} move?",
    "end_color": "What color is it at the end?",
    "start_color": "What color is it at the start?",
}
_SALT = 37  # keeps this set's random streams apart from the other built-in sets' for the same seed


@dataclass(frozen=True)
class Clip:
    """What one synthetic clip shows."""

    shape: str
    direction: str
    start_color: str
    end_color: str
    offset: int  # where across the other axis the shape travels (pixels from the centre line)
    background: int  # grey level

    def answer(self, kind: str) -> str:
        return self.direction if kind == "motion" else getattr(self, kind)

    def question(self, kind: str) -> str:
        return QUESTIONS[kind].format(shape=self.shape)

    def caption(self) -> str:
        return f"a {self.start_color} {self.shape} moves {self.direction} and turns {self.end_color}"

    def box(self, t: int) -> tuple[float, float, float, float]:
        """The shape's box in frame ``t``: from one edge to the other along its direction."""
        dx, dy = DIRECTIONS[self.direction]
        travel = (SIZE - SHAPE_SIZE) * t / (FRAMES - 1)
        along = travel if dx + dy > 0 else SIZE - SHAPE_SIZE - travel
        across = (SIZE - SHAPE_SIZE) / 2 + self.offset
        x0, y0 = (along, across) if dx else (across, along)
        return x0, y0, x0 + SHAPE_SIZE - 1, y0 + SHAPE_SIZE - 1

    def color(self, t: int) -> str:
        return self.start_color if t < FRAMES // 2 else self.end_color

    def frame(self, t: int) -> Image.Image:
        img = Image.new("RGB", (SIZE, SIZE), (self.background,) * 3)
        draw_shape(ImageDraw.Draw(img), self.shape, self.color(t), self.box(t))
        return img


def clip(seed: int, split: str, index: int) -> Clip:
    """The clip of sample ``index`` of ``split`` (deterministic)."""
    rng = np.random.default_rng([seed, SPLITS[split], index, _SALT])
    start, end = (list(COLORS)[int(i)] for i in rng.choice(len(COLORS), size=2, replace=False))
    return Clip(
        shape=SHAPES[int(rng.integers(len(SHAPES)))],
        direction=list(DIRECTIONS)[int(rng.integers(len(DIRECTIONS)))],
        start_color=start,
        end_color=end,
        offset=int(rng.integers(-12, 13)),
        background=int(rng.integers(0, 60)),
    )


def video_name(split: str, index: int) -> str:
    """Name of a clip in records, relative to the video folder."""
    return f"synthetic_video/{split}/{index:06d}.mp4"


def question_kind(index: int) -> str:
    """The question kind of QA sample ``index``: in rotation, so every split holds the kinds in equal shares."""
    return KINDS[index % len(KINDS)]


def make_record(seed: int, split: str, index: int, task: str) -> dict[str, Any]:
    """LLaVA-Video record of sample ``index``: a caption (``task="caption"``) or one question (``"qa"``, kinds in
    rotation so every split holds them in equal shares)."""
    c = clip(seed, split, index)
    if task == "caption":
        question, answer = "Describe the video.", c.caption()
    else:
        kind = question_kind(index)
        question, answer = c.question(kind), c.answer(kind)
    conv = [{"from": "human", "value": f"{VIDEO_TOKEN}\n{question}"}, {"from": "gpt", "value": answer}]
    return {"id": f"synthetic_video-{split}-{index}", "video": video_name(split, index), "conversations": conv}


def video_records(seed: int, split: str, num_samples: int, task: str) -> list[dict[str, Any]]:
    """``num_samples`` records of ``split`` (``train`` or the held-out ``val``)."""
    return [make_record(seed, split, i, task) for i in range(num_samples)]


def write_clip(c: Clip, path: str) -> None:
    """Encode ``c`` as an H.264 mp4 at ``path`` (written beside it, then renamed into place)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".mp4", dir=os.path.dirname(path))
    os.close(fd)
    try:
        with av.open(tmp, "w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=RATE)
            stream.width = stream.height = SIZE
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "10", "threads": "1"}
            for t in range(FRAMES):
                frame = av.VideoFrame.from_image(c.frame(t))
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_videos(seed: int, records: list[dict[str, Any]], folder: str) -> None:
    """Write the clip of every record of ``video_records(seed, ...)`` under ``folder`` that is not there yet."""
    for record in records:
        path = os.path.join(folder, record["video"])
        if not os.path.exists(path):
            split, index = record["video"].split("/")[1:]
            write_clip(clip(seed, split, int(index[: -len(".mp4")])), path)


def default_folder(seed: int) -> str:
    """Where the clips go when no ``model.data.video_folder`` is set (the user's cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "neva", f"synthetic_video-v1-seed{seed}")  # v1: FRAMES, SIZE, RATE of today
