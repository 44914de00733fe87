"""Video-MME: multiple choice on videos, with and without subtitles, per duration (short / medium / long), as
lmms-eval 0.7.3 runs ``videomme`` and ``videomme_w_subtitle`` (``lmms_eval/tasks/videomme/utils.py``).

Files: the Hugging Face snapshot of ``lmms-eval/Video-MME`` with its archives unpacked where lmms-eval unpacks them
(its cache folder ``videomme/``): ``test`` parquet files (``videomme/test-*.parquet``: ``videoID``, ``duration``,
``domain``, ``sub_category``, ``task_type``, ``question_id``, ``question``, ``options`` (``A. …`` texts),
``answer``), ``data/<videoID>.mp4`` (``.MP4``, ``.mkv``: the first present, as lmms-eval looks) and
``subtitle/<videoID>.srt`` (a video without one has no subtitles).

Frames: 32, uniformly over the video (``np.linspace(0, total - 1, 32, dtype=int)``): the sampling of lmms-eval's
LLaVA-OneVision wrapper (``max_frames_num`` 32; other wrappers choose their own), and the frames the subtitle
variant's ``frame_num: 32`` picks subtitles at. Decoded by neva's video reader (PyAV), whose frame count and rate come from the
stream header where lmms-eval's subtitle step reads OpenCV's (the same numbers for files whose header has them).

Prompt (``default`` kwargs): ``Select the best answer … Respond with only the letter (A, B, C, or D) of the correct
option.``, the question, the options one per line, then ``\\nAnswer with the option's letter from the given choices
directly.`` (without subtitles: ``videomme.yaml``), or, with subtitles (``videomme_w_subtitle.yaml``), ``This video's
subtitles are listed below: `` and the subtitles shown at the 32 sampled frames (each subtitle once, its
``<font color="white" size=".72c">`` text; ``No subtitles available`` without a subtitle file) in front, ``The best
answer is:`` at the end. 16 new tokens.

Scoring: the letter ``choice_letter.extract_choice`` reads among A-D equals the answer; accuracy in percent overall
(lmms-eval's ``videomme_perception_score``) and per duration, domain, sub-category and task type (what lmms-eval
logs). Standard errors (in percent): the plain one and lmms-eval's clustered one over questions of the same video
(``cluster_key: videoID``; ``clustered_stderr``, Miller 2024, eq. 4).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from neva.benchmarks.choice_letter import extract_choice
from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean_stderr
from neva.data.video import read_video_file
from neva.data.video_decode import VideoLimits, open_container, read_header

FRAMES = 32
# Video-MME's long videos run up to an hour; the reader's other caps stay as training has them.
LIMITS = VideoLimits(num_frames=FRAMES, max_seconds=2 * 3600.0)
OPTION_PROMPT = ("Select the best answer to the following multiple-choice question based on the video and the "
                 "subtitles. Respond with only the letter (A, B, C, or D) of the correct option.")  # fmt: skip
POST_PROMPT = "\nAnswer with the option's letter from the given choices directly."
SUBTITLES_PROMPT = "This video's subtitles are listed below: \n"
SUBTITLE_TEXT = re.compile(r'<font color="white" size=".72c">(.*?)</font>')
GROUPS = ("duration", "domain", "sub_category", "task_type")
SCORED = ("videoID", "question_id", "answer", *GROUPS)


@dataclasses.dataclass(frozen=True)
class BenchmarkVideo:
    """A question's video, sampled when it is asked."""

    path: Path

    def frames(self) -> np.ndarray:
        """uint8 ``[32, H, W, 3]``. Raises VideoError (a ValueError): a file the reader refuses."""
        return read_video_file(self.path, LIMITS)


def video_path(folder: Path, video_id: str) -> Path:
    """``data/<id>.mp4``, else ``.MP4``, else ``.mkv`` (lmms-eval's order); the ``.mp4`` path when none is there."""
    for suffix in (".mp4", ".MP4", ".mkv"):
        if (folder / "data" / f"{video_id}{suffix}").is_file():
            return folder / "data" / f"{video_id}{suffix}"
    return folder / "data" / f"{video_id}.mp4"


def question_block(doc: dict[str, Any]) -> str:
    return doc["question"] + "\n" + "\n".join(str(o) for o in doc["options"])


def prompt(doc: dict[str, Any]) -> str:
    """``videomme_doc_to_text``."""
    return f"{OPTION_PROMPT}\n{question_block(doc)}\n{POST_PROMPT}"


def parse_time(text: str) -> float:
    h, m, s_ms = text.split(":")
    s, ms = s_ms.split(",")
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def load_subtitles(path: Path) -> dict[tuple[float, float], str]:
    """An .srt's cues: (start s, end s) → text lines joined by spaces (a repeated time range keeps its first place,
    its last text)."""
    cues: dict[tuple[float, float], str] = {}
    for section in path.read_text(encoding="utf-8").split("\n\n"):
        lines = section.split("\n")
        if section.strip() and len(lines) >= 3:
            start, end = lines[1].split(" --> ")
            cues[parse_time(start), parse_time(end)] = " ".join(lines[2:])
    return cues


def shown_subtitles(video: Path, srt: Path) -> str:
    """The subtitles on screen at the sampled frames (``videomme_doc_to_text_subtitle``'s rule)."""
    with open_container(str(video), video.name) as container:
        _, header = read_header(container, video.name, LIMITS)
    by_frame = [(int(s * header.rate), int(e * header.rate), text) for (s, e), text in load_subtitles(srt).items()]
    sampled = np.linspace(0, header.total - 1, FRAMES, dtype=int).tolist()
    shown = [i for f in sampled for i, (start, end, _) in enumerate(by_frame) if start <= f < end]
    texts = []
    for i in list(set(shown)):  # lmms-eval's order: a set's iteration order of the cue numbers
        found = SUBTITLE_TEXT.findall(by_frame[i][2])
        if found:
            texts.append(found[0])
    return "\n".join(texts)


def subtitle_prompt(doc: dict[str, Any], folder: Path) -> str:
    """``videomme_doc_to_text_subtitle`` (``frame_num: 32``)."""
    srt = folder / "subtitle" / f"{doc['videoID']}.srt"
    subtitles = shown_subtitles(video_path(folder, doc["videoID"]), srt) if srt.exists() else "No subtitles available"
    return f"{SUBTITLES_PROMPT}{subtitles}\n{OPTION_PROMPT}\n{question_block(doc)}\nThe best answer is:"


def reader(with_subtitles: bool):
    def read(folder: Path) -> Read:
        read = Read([])
        for doc in read_rows(split_files(folder, "test")):
            path = video_path(folder, doc["videoID"])
            # A missing video is refused by the runner (with the questions asked); its prompt is then never used.
            text = subtitle_prompt(doc, folder) if with_subtitles and path.is_file() else prompt(doc)
            meta = {k: doc[k] for k in SCORED}
            read.questions.append(
                Question(doc["question_id"], text, text, (), meta=meta, videos=(BenchmarkVideo(path),))
            )
        return read

    return read


def clustered_stderr(scores: list[float], clusters: list[Any]) -> float | None:
    """``sqrt(SE_CLT² + Σ_c Σ_{i≠j} (s_ic - s̄)(s_jc - s̄) / n²)`` (lmms-eval's ``clustered_stderr``)."""
    n = len(scores)
    if n < 2 or len(set(clusters)) < 2:
        return None
    mean = sum(scores) / n
    se2 = sum((s - mean) ** 2 for s in scores) / (n - 1) / n
    by_cluster: dict[Any, list[float]] = defaultdict(list)
    for s, c in zip(scores, clusters):
        by_cluster[c].append(s - mean)
    cross = sum(sum(d) ** 2 - sum(x * x for x in d) for d in by_cluster.values()) / (n * n)
    return math.sqrt(se2 + cross)


def right(doc: dict[str, Any], text: str) -> float:
    return 1.0 if extract_choice(text, ("A", "B", "C", "D")).lower() == doc["answer"].lower() else 0.0


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    scored = [(doc, right(doc, text)) for doc, text in pairs]
    scores = [s for _, s in scored]

    def percent(values: list[float]) -> float:
        return 100 * sum(values) / len(values) if values else 0

    plain, clustered = mean_stderr(scores), clustered_stderr(scores, [d["videoID"] for d, _ in scored])
    out: dict[str, Any] = {
        "accuracy": percent(scores), "accuracy_stderr": None if plain is None else 100 * plain,
        "accuracy_stderr_clustered": None if clustered is None else 100 * clustered, "n": len(scores),
    }  # fmt: skip
    for group in GROUPS:
        values: dict[str, list[float]] = defaultdict(list)
        for doc, s in scored:
            values[doc[group]].append(s)
        out[group] = {k: percent(v) for k, v in sorted(values.items())}
    return out


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
