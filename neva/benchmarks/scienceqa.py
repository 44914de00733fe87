"""ScienceQA (test, image and text questions): accuracy as LLaVA's ``llava/eval/eval_science_qa.py`` parses options.

Layout (``scienceqa/``): ``llava_test_CQM-A.json`` (a list of ``{"id", "conversations": [{"value": question}],
"image"?}``, what ``scripts/v1_5/eval/sqa.sh`` passes), ``problems.json`` (each problem's ``choices`` and ``answer``
index), ``pid_splits.json`` (``test``: the problem ids scored) and ``images/test/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read, load_json, need

LETTER_INSTRUCTION = "Answer with the option's letter from the given choices directly."
"""``--single-pred-prompt`` (``model_vqa_science.py``, ``model_vqa_mmbench.py``): after the question on a new line."""
OPTIONS = ("A", "B", "C", "D", "E")


def read(folder: Path) -> Read:
    records = load_json(need(folder / "llava_test_CQM-A.json"))
    need(folder / "problems.json"), need(folder / "pid_splits.json")  # the scorer's, checked before generating
    read = Read([])
    for record in records:
        try:
            question = record["conversations"][0]["value"].replace("<image>", "").strip()
        except (KeyError, IndexError, TypeError, AttributeError):
            read.skipped += 1
            continue
        text = f"{question}\n{LETTER_INSTRUCTION}"
        images = (folder / "images" / "test" / record["image"],) if "image" in record else ()
        # The record's prompt says <image> for a question with one (the scorer's image-question count reads it).
        prompt = f"<image>\n{text}" if images else text
        read.questions.append(Question(record["id"], text, prompt, images))
    return read


def parse_option(text: str) -> str | None:
    """The letter an answer gives: the whole answer, ``X. …``, or a single ``The answer is X.``."""
    if text in OPTIONS:
        return text
    if len(text) >= 3 and text[0] in OPTIONS and text[1:3] == ". ":
        return text[0]
    found = re.findall(r"The answer is ([A-Z]).", text)
    return found[0] if len(found) == 1 else None


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    test_ids = load_json(need(folder / "pid_splits.json"))["test"]
    problems = load_json(need(folder / "problems.json"))
    answers = {a["question_id"]: a for _, a in answered if a is not None}
    correct = total = image_correct = image_total = 0
    for pid in test_ids:
        answer = answers.get(pid)  # none (skipped or absent): FAILED, wrong
        letter = parse_option(answer["text"]) if answer else None
        choices = problems[pid]["choices"]
        right = (
            letter is not None
            and letter in OPTIONS[: len(choices)]
            and OPTIONS.index(letter) == problems[pid]["answer"]
        )
        with_image = answer is not None and "<image>" in answer["prompt"]
        correct, total = correct + right, total + 1
        image_correct, image_total = image_correct + (right and with_image), image_total + with_image
    return {
        "accuracy": 100 * correct / total if total else 0.0, "correct": correct, "count": total,
        "image_accuracy": 100 * image_correct / image_total if image_total else 0.0, "image_count": image_total,
    }  # fmt: skip
