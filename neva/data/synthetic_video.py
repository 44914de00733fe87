"""Built-in synthetic video task: a shape moving to the left / right / top / bottom while its colour changes, in mp4s.

A clip is ``FRAMES`` frames of ``SIZE`` × ``SIZE`` pixels at ``RATE`` frames/s (H.264, written with PyAV): one filled
shape (``neva.data.synthetic``'s shapes and palette) starts near the centre of the frame and travels in a straight
line to one edge, in its first colour for the first half of the clip and its second colour for the rest. The
questions need more than one frame:

- ``motion``: "Which side does the square move to?" (left / right / top / bottom: one token each in the built-in
  tokenizer, " up" and " down" are not): where the shape starts is drawn apart from where it goes, so the first frame
  (the one one-frame sampling takes) is the same for all four directions.
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
SHAPE_SIZE = 24
# Grey added to the background's top left, top right, bottom left and bottom right quarter: a random tiny tower's
# position embeddings are too weak to tell where a patch is, the board's shades tell it.
QUADRANT_SHADES = (0, 30, 60, 90)
START = 6  # the shape starts up to this many pixels off the centred box along each axis: it travels 14 px or more
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "top": (0, -1), "bottom": (0, 1)}
KINDS = ("motion", "end_color", "start_color")
# Accuracy of guessing uniformly among each kind's possible answers (a direction; a palette colour).
CHANCE = {kind: 1 / (len(DIRECTIONS) if kind == "motion" else len(COLORS)) for kind in KINDS}
QUESTIONS = {
    "motion": "Which side does the {shape} move to?",
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
    start: tuple[int, int]  # where the shape is in frame 0: (x, y) pixels from the centred box, whatever the direction
    background: int  # grey level of the darkest quarter

    def answer(self, kind: str) -> str:
        return self.direction if kind == "motion" else getattr(self, kind)

    def question(self, kind: str) -> str:
        return QUESTIONS[kind].format(shape=self.shape)

    def caption(self) -> str:
        return f"a {self.start_color} {self.shape} moves to the {self.direction} and turns {self.end_color}"

    def box(self, t: int) -> tuple[float, float, float, float]:
        """The shape's box in frame ``t``: from ``start`` (frame 0) in a straight line to the edge it moves to (the
        last frame)."""
        corner = []
        for offset, d in zip(self.start, DIRECTIONS[self.direction]):
            first = (SIZE - SHAPE_SIZE) / 2 + offset
            last = {-1: 0, 0: first, 1: SIZE - SHAPE_SIZE}[d]
            corner.append(first + (last - first) * t / (FRAMES - 1))
        x0, y0 = corner
        return x0, y0, x0 + SHAPE_SIZE - 1, y0 + SHAPE_SIZE - 1

    def color(self, t: int) -> str:
        return self.start_color if t < FRAMES // 2 else self.end_color

    def frame(self, t: int) -> Image.Image:
        img = Image.new("RGB", (SIZE, SIZE))
        draw, half = ImageDraw.Draw(img), SIZE // 2
        for q, shade in enumerate(QUADRANT_SHADES):
            x, y = (q % 2) * half, (q // 2) * half
            draw.rectangle((x, y, x + half - 1, y + half - 1), fill=(self.background + shade,) * 3)
        draw_shape(draw, self.shape, self.color(t), self.box(t))
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
        start=(int(rng.integers(-START, START + 1)), int(rng.integers(-START, START + 1))),
        background=int(rng.integers(0, 40)),
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
    return os.path.join(cache, "neva", f"synthetic_video-v2-seed{seed}")  # v2: centre-to-edge clips on a quadrant board
