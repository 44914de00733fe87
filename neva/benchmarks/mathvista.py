"""MathVista (testmini): rule-based answer extraction and accuracy, as lmms-eval 0.7.3 scores
``mathvista_testmini_format`` (``lmms_eval/tasks/mathvista/utils.py``, ``mathvista_evals.py``), with an optional
LLM judge for the answers the rules cannot read.

Files: the Hugging Face snapshot of ``AI4Math/MathVista``: ``testmini`` parquet files, columns ``pid``,
``question``, ``decoded_image``, ``choices`` (a list, or none), ``unit``, ``precision``, ``answer``,
``question_type`` (``multi_choice`` / ``free_form``), ``answer_type`` (``text`` / ``integer`` / ``float`` /
``list``), ``query``.

Prompt (``mathvista_testmini_format.yaml``: ``shot_type: format-prompt``, no shots, no caption or OCR): the question
(`` (Unit: u)`` when it has one), the choices as ``A. …`` lines, then the answer-format hint (``Answer with the
option's letter from the given choices directly.``, ``Answer the question using a single integer number.``, a
floating-point number with one or two decimal places, or a Python list). The YAML asks 16384 new tokens.

Extraction (``extract_answer``): an empty answer gives ``""``; a multiple-choice answer that is one of the choices is
it; for an integer (float) answer type, an answer that ``int()`` (``float()``) reads is that number. Every other
answer goes to an LLM in lmms-eval (``gpt-4o``, with the MathVista few-shot extraction prompt); here that judge is
off unless one is plugged in (``score_answers(..., judge=...)``): its extraction is then ``""``, which is what
lmms-eval gives when its judge does not answer. The output says which (``judge``).

Normalisation (``normalize_extracted_answer``): multiple choice: ``(x)`` read as the letter ``X``, a letter naming a
choice is that choice, anything else the nearest choice by Levenshtein distance (the first of equals); integer:
``str(int(float(x)))``; float: rounded to the question's ``precision`` decimals; list: ``str``. Right when it equals
the answer as text, both stripped. Accuracy in percent, rounded to 2 decimals, as lmms-eval reports it.

Where lmms-eval 0.7.3 is wrong: it rounds a float answer by ``round(x, precision)`` with the dataset's ``precision``,
a float (``1.0``), which raises; the exception makes the extraction None, so every float question scores wrong. Here
it is rounded to ``int(precision)`` decimals, as MathVista's own ``evaluation/calculate_score.py`` does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neva.benchmarks.edit_distance import levenshtein
from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean_stderr

Judge = Callable[[dict[str, Any], str], str]
"""``(problem, answer)`` → the extracted answer: lmms-eval's LLM step (its prompt: MathVista's few-shot extraction
demo, the problem's ``query`` and the answer); plugged in by a caller that has a model to ask."""

SCORED = ("pid", "question_type", "answer_type", "choices", "precision", "answer", "query")
HINTS = {
    "integer": "Answer the question using a single integer number.",
    ("float", 1): "Answer the question using a single floating-point number with one decimal place.",
    ("float", 2): "Answer the question using a single floating-point number with two decimal places.",
    "list": "Answer the question using a Python list.",
}
CHOICE_HINT = "Answer with the option's letter from the given choices directly."


def prompt(doc: dict[str, Any]) -> str:
    """``create_one_query`` with ``shot_type: format-prompt``, no shots."""
    question = doc["question"] + (f" (Unit: {doc['unit']})" if doc.get("unit") else "")
    choices = "\n".join(f"{chr(ord('A') + i)}. {c}" for i, c in enumerate(doc.get("choices") or []))
    if doc["question_type"] == "multi_choice":
        hint = CHOICE_HINT
    elif doc["answer_type"] == "float":
        hint = HINTS.get(("float", doc.get("precision")), "")
    else:
        hint = HINTS.get(doc["answer_type"], "")
    return "\n".join(e for e in (question, choices, hint) if e != "").strip()


def read(folder: Path) -> Read:
    read = Read([])
    for doc in read_rows(split_files(folder, "testmini")):
        text = prompt(doc)
        meta = {k: doc.get(k) for k in SCORED}
        read.questions.append(Question(doc["pid"], text, text, (doc["decoded_image"],), meta=meta))
    return read


def extract(response: str, doc: dict[str, Any], judge: Judge | None) -> str:
    """``extract_answer`` without quick extraction (the task's ``quick_extract: false``)."""
    if not response:
        return ""
    if doc["question_type"] == "multi_choice" and response in (doc.get("choices") or []):
        return response
    for kind, parse in (("integer", int), ("float", float)):
        if doc["answer_type"] == kind:
            try:
                return str(parse(response))
            except ValueError:
                pass
    return judge(doc, response) if judge is not None else ""


def normalize(extraction: str, doc: dict[str, Any]) -> str | None:
    """``normalize_extracted_answer``, floats rounded to ``int(precision)`` decimals (MathVista's rule)."""
    if doc["question_type"] == "multi_choice":
        choices = list(doc["choices"])
        extraction = extraction.strip()
        letter = re.findall(r"\(([a-zA-Z])\)", extraction)
        if letter:
            extraction = letter[0].upper()
        options = [chr(ord("A") + i) for i in range(len(choices))]
        if extraction in options:
            return choices[options.index(extraction)]
        distances = [levenshtein(extraction, c) for c in choices]
        return choices[distances.index(min(distances))]
    try:
        if doc["answer_type"] == "integer":
            return str(int(float(extraction)))
        if doc["answer_type"] == "float":
            return str(round(float(extraction), int(doc["precision"])))
    except (ValueError, TypeError, OverflowError):
        return None
    return str(extraction) if doc["answer_type"] == "list" else extraction


def right(doc: dict[str, Any], text: str, judge: Judge | None = None) -> bool:
    prediction = normalize(extract(text.strip(), doc, judge), doc)
    return doc.get("answer") is not None and str(prediction).strip() == str(doc["answer"]).strip()


def score_answers(pairs: list[tuple[dict[str, Any], str]], judge: Judge | None = None) -> dict[str, Any]:
    scores = [float(right(doc, text, judge)) for doc, text in pairs]
    correct = int(sum(scores))
    accuracy = round(correct / len(scores) * 100, 2) if scores else 0.0
    stderr = mean_stderr(scores)
    return {"accuracy": accuracy, "accuracy_stderr": None if stderr is None else 100 * stderr, "correct": correct,
            "n": len(scores), "judge": "plugged in" if judge else "none (rule-based extraction only; lmms-eval's "
            "default asks gpt-4o for the answers the rules cannot read)"}  # fmt: skip


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
