"""Reading a benchmark's files in the layout of LLaVA's evaluation guide (``docs/Evaluation.md``), and what a
question is once read."""

from __future__ import annotations

import base64
import csv
import dataclasses
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

from PIL import Image

from neva.errors import ConfigError


class MissingFile(ConfigError):
    """A file of a benchmark's layout is not there (the runner adds the layout it expected)."""


@dataclasses.dataclass(frozen=True)
class InlineImage:
    """An image the question file carries (MMBench's base64), decoded only when its question is asked: a whole
    benchmark's decoded images would not fit in memory."""

    data: str

    def open(self) -> Image.Image:
        """Raises ValueError (not base64) or OSError (not an image)."""
        return Image.open(io.BytesIO(base64.b64decode(self.data))).convert("RGB")


@dataclasses.dataclass(frozen=True)
class Question:
    """One question as the model is asked it and as its answer record names it.

    ``text`` is what the model gets after its image tag (LLaVA puts ``<image>\\n`` in front, as neva's prompt builder
    does); ``prompt`` is what the answer record's ``prompt`` says (LLaVA's ``cur_prompt``); ``images``: paths, or
    ``InlineImage``s; ``extra``: more fields of the answer record
    (MMBench's ``round_id``, ``options``, ``option_char``); ``meta``: what the scorer needs (a category, the
    answer key); ``videos``: objects with a ``path`` and a ``frames()`` that samples it (Video-MME's)."""

    question_id: Any
    text: str
    prompt: str
    images: tuple[Any, ...] = ()
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    videos: tuple[Any, ...] = ()


@dataclasses.dataclass
class Read:
    """A benchmark's questions and how many of its records could not be asked (each a counted skip)."""

    questions: list[Question]
    skipped: int = 0


def need(path: Path) -> Path:
    """``path``, which must exist.

    Raises:
        MissingFile: it does not.
    """
    if not path.exists():
        raise MissingFile(f"{path} is missing")
    return path


def load_json(path: Path) -> Any:
    try:
        return json.loads(need(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not JSON ({err})") from err


def load_jsonl(path: Path) -> list[Any]:
    """The file's JSON lines; a line that is not JSON is kept as None (a record to skip and count)."""
    out: list[Any] = []
    for line in need(path).read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append(None)
    return out


def load_tsv(path: Path) -> list[dict[str, str]]:
    """A TSV with a header row (MMBench's: base64 images make its fields long)."""
    csv.field_size_limit(sys.maxsize)
    with open(need(path), newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def vqa_loader_questions(
    question_file: Path, image_folder: Path, meta_keys: tuple[str, ...] = (), scorer_files: tuple[Path, ...] = ()
) -> Read:
    """Question records as LLaVA's ``model_vqa_loader`` reads them (``question_id``, ``image`` relative to the image
    folder, ``text``: the prompt, its instruction already in it); ``meta_keys``: record fields the scorer needs. A
    record without these three is skipped and counted. ``scorer_files``: what the scorer reads, checked now so that a
    missing one is refused before any answer is generated.

    Raises:
        MissingFile: the question file or one of ``scorer_files``.
    """
    records = load_jsonl(question_file)
    for path in scorer_files:
        need(path)
    read = Read([])
    for record in records:
        if not isinstance(record, dict) or not all(k in record for k in ("question_id", "image", "text")):
            read.skipped += 1
            continue
        text = str(record["text"])
        meta = {k: record.get(k) for k in meta_keys}
        read.questions.append(Question(record["question_id"], text, text, (image_folder / record["image"],), meta=meta))
    return read


def missing_images(questions: list[Question]) -> list[Path]:
    """The image and video paths the questions name that are not files (an image held in a file of the benchmark, as
    MMBench's base64 or a parquet cell, is not a path: it is checked when asked)."""
    images = [Path(i) for q in questions for i in q.images if is_path(i)]
    return [p for p in [*images, *(v.path for q in questions for v in q.videos)] if not p.is_file()]


def is_path(image: Any) -> bool:
    """A question's image given as a file path (else an object whose ``open()`` decodes it)."""
    return isinstance(image, (str, os.PathLike))
