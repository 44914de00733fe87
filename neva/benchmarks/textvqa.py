"""TextVQA (val, with OCR tokens in the prompt): soft VQA accuracy as LLaVA's ``llava/eval/eval_textvqa.py`` scores
it with ``m4c_evaluator.TextVQAAccuracyEvaluator``.

Layout (``textvqa/``): ``llava_textvqa_val_v051_ocr.jsonl`` (``question_id``: the image id, ``image``, ``text``: the
question, a ``Reference OCR token:`` line and the short-answer instruction), ``TextVQA_0.5.1_val.json`` (``data``:
``image_id``, ``question``, the ten ``answers``) and ``train_images/``. An answer is matched to its annotation by
(``question_id``, the question read back out of its ``prompt``), as the official script matches it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read, load_json, need, vqa_loader_questions
from neva.benchmarks.vqa_normalize import vqa_soft_score


def read(folder: Path) -> Read:
    return vqa_loader_questions(
        folder / "llava_textvqa_val_v051_ocr.jsonl",
        folder / "train_images",
        scorer_files=(folder / "TextVQA_0.5.1_val.json",),
    )


def question_of(prompt: str) -> str | None:
    """The question inside a prompt, lower-cased, by the official script's cases; None where none applies."""
    lines = prompt.split("\n")
    if prompt.startswith("OCR tokens: "):
        match = re.search(r"Question: (.*?) Short answer:", prompt, re.DOTALL)
        question = match.group(1) if match else None
    elif "Reference OCR token: " in prompt and len(lines) == 3:
        question = lines[1] if prompt.startswith("Reference OCR token:") else lines[0]
    elif len(lines) == 2:
        question = lines[0]
    else:
        question = None
    return None if question is None else question.lower()


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    data = load_json(need(folder / "TextVQA_0.5.1_val.json"))["data"]
    references = {(d["image_id"], d["question"].lower()): d["answers"] for d in data}
    scores, unmatched = [], 0
    for _, answer in answered:
        key = None if answer is None else (answer["question_id"], question_of(answer["prompt"]))
        if key not in references:
            unmatched += answer is not None  # the official script stops there; here it is counted
            continue
        scores.append(vqa_soft_score(answer["text"], references[key]))
    return {
        "accuracy": 100 * sum(scores) / len(scores) if scores else 0.0,  # eval_textvqa.py prints percent
        "n": len(scores),
        "unmatched": unmatched,
    }
