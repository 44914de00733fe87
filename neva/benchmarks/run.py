"""One benchmark, end to end: read its files and refuse missing ones or missing images (``load_benchmark``, before a
model is loaded), then answer in batches, write the answers as LLaVA's ``model_vqa_loader`` writes them, score, and
write ``scores.json``."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from neva.benchmarks.files import MissingFile, Question, Read, is_path, missing_images
from neva.benchmarks.table import BENCHMARKS
from neva.errors import ConfigError

AnswerAll = Callable[[Iterable[tuple[Any, ...] | Exception], int], Iterator[str | Exception]]
"""``(items, batch size)`` → each item's answer in order, or the exception that made it unanswerable; an item may be
an exception already, given back in its place (``neva.inference.Answerer.answer_all`` with ``keep_going``)."""


def benchmark_folder(data_dir: Path, name: str) -> Path:
    """``DIR/<folder>`` when ``--data-dir`` is LLaVA's ``playground/data/eval``, else ``DIR`` itself."""
    folder = data_dir / BENCHMARKS[name].folder
    return folder if folder.is_dir() else data_dir


def asked(question: Question) -> tuple[Any, ...] | Exception:
    """The item the answerer gets (with its videos' sampled frames when it has videos); an image held in a benchmark
    file that does not decode, or a video that does not, makes it a counted skip (the exception)."""
    try:
        images = tuple(i if is_path(i) else i.open() for i in question.images)
        if question.videos:
            return question.text, images, tuple(v.frames() for v in question.videos)
        return question.text, images
    except (ValueError, OSError, Image.DecompressionBombError) as err:  # a video's VideoError is a ValueError
        return err


def answer_record(question: Question, text: str, model_id: str) -> dict[str, Any]:
    """An answer line as ``model_vqa_loader.py`` writes it (MMBench's also name the round and its options)."""
    return {
        "question_id": question.question_id, "prompt": question.prompt, "text": text, **question.extra,
        "answer_id": uuid.uuid4().hex[:22], "model_id": model_id, "metadata": {},
    }  # fmt: skip


@dataclasses.dataclass
class Loaded:
    """A benchmark read and checked, ready to answer."""

    name: str
    folder: Path
    read: Read
    expected: str  # the layout, for an error that names a missing file


def load_benchmark(name: str, data_dir: Path, limit: int | None = None) -> Loaded:
    """Read ``name``'s questions from ``data_dir`` (before a model is loaded: bad input fails fast); ``limit``: only
    the first that many questions (in the question file's order), the rest neither checked nor asked.

    Raises:
        ConfigError: a missing file (named, with the layout expected) or images the questions name that are absent.
    """
    bench = BENCHMARKS[name]
    layout = (
        "its Hugging Face snapshot" if bench.source.startswith("lmms-eval") else "LLaVA's docs/Evaluation.md layout"
    )
    expected = f"expected {bench.layout} under {data_dir}/{bench.folder}/ ({layout})"
    folder = benchmark_folder(data_dir, name)
    try:
        read = bench.read(folder)
    except MissingFile as err:
        raise ConfigError(f"{name}: {err}; {expected}") from None
    if limit is not None:
        read.questions = read.questions[:limit]
    absent = missing_images(read.questions)
    if absent:
        kind = "video(s)" if any(q.videos for q in read.questions) else "image(s)"
        raise ConfigError(f"{name}: {len(absent)} {kind} missing, the first {absent[0]}; {expected}")
    return Loaded(name, folder, read, expected)


def run_benchmark(
    loaded: Loaded, output_dir: Path, answer_all: AnswerAll, model_id: str, batch_size: int, max_new_tokens: int
) -> dict[str, Any]:
    """Answer, write ``answers.jsonl``, score, write ``scores.json``; ``max_new_tokens``: what ``answer_all``
    generates at most (reported with the scores).

    Raises:
        ConfigError: a file only the scorer reads is missing (the answers are written by then).
    """
    read, name = loaded.read, loaded.name
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    answers = answer_all((asked(q) for q in read.questions), batch_size)  # decoded batch by batch
    answered: list[tuple[Question, dict | None]] = []
    with open(output_dir / "answers.jsonl", "w") as f:
        for question, answer in zip(read.questions, answers):
            record = None if isinstance(answer, Exception) else answer_record(question, answer.strip(), model_id)
            if record is not None:
                f.write(json.dumps(record) + "\n")
            answered.append((question, record))
    seconds = time.perf_counter() - start
    try:
        scores = BENCHMARKS[name].score(loaded.folder, answered, output_dir)
    except MissingFile as err:
        raise ConfigError(f"{name}: {err}; {loaded.expected}") from None
    skipped = read.skipped + sum(a is None for _, a in answered)
    result = {"suite": name, **scores, "units": BENCHMARKS[name].units(scores), "questions": len(read.questions),
              "skipped": skipped,
              "questions_per_s": round(len(read.questions) / seconds, 3) if seconds else None,
              "answers_file": str(output_dir / "answers.jsonl"), "max_new_tokens": max_new_tokens}  # fmt: skip
    (output_dir / "scores.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def score_answers(loaded: Loaded, answers_file: Path, output_dir: Path) -> dict[str, Any]:
    """Score an answers file written before (``answers.jsonl`` of an earlier run, or any file of
    ``model_vqa_loader``'s records) with the benchmark's official rule, as ``run_benchmark`` scores its own; a question
    the file has no answer for counts as skipped. Writes ``scores.json``.

    Raises:
        ConfigError: an answers line that is not JSON or names no ``question_id``; a file only the scorer reads is
            missing.
    """
    by_id: dict[Any, dict] = {}
    for number, line in enumerate(answers_file.read_text().splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
                by_id[record["question_id"]] = record
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{answers_file}:{number}: not an answer record with a question_id") from None
    answered = [(q, by_id.get(q.question_id)) for q in loaded.read.questions]
    try:
        scores = BENCHMARKS[loaded.name].score(loaded.folder, answered, output_dir)
    except MissingFile as err:
        raise ConfigError(f"{loaded.name}: {err}; {loaded.expected}") from None
    skipped = loaded.read.skipped + sum(a is None for _, a in answered)
    result = {"suite": loaded.name, **scores, "units": BENCHMARKS[loaded.name].units(scores),
              "questions": len(loaded.read.questions), "skipped": skipped,
              "answers_file": str(answers_file)}  # fmt: skip
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "scores.json").write_text(json.dumps(result, indent=1) + "\n")
    return result
