"""MME (yes/no on 14 subtasks): perception and cognition totals as the MME ``eval_tool/calculation.py`` computes them
from the answers LLaVA's ``convert_answer_to_mme.py`` converts.

Layout (``MME/``): ``llava_mme.jsonl`` (``question_id``: ``<category>/<image file>``, ``image``, ``text``) and
``MME_Benchmark_release_version/<category>/``: the images and, per image, ``<image stem>.txt`` of ``question<TAB>
answer`` lines (both in ``images/`` and ``questions_answers_YN/`` where the category has those folders).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read, need, vqa_loader_questions

RELEASE = "MME_Benchmark_release_version"
PERCEPTION = ("existence", "count", "position", "color", "posters", "celebrity", "scene", "landmark", "artwork", "OCR")
COGNITION = ("commonsense_reasoning", "numerical_calculation", "text_translation", "code_reasoning")
SHORT_ANSWER = "Answer the question using a single word or phrase."
YES_NO = " Please answer yes or no."


def read(folder: Path) -> Read:
    return vqa_loader_questions(folder / "llava_mme.jsonl", folder / RELEASE, scorer_files=(folder / RELEASE,))


def answer_key(folder: Path) -> dict[tuple[str, str, str], str]:
    """``(category, <image stem>.txt, question)`` → ``Yes`` / ``No``, from the release's question files."""
    key = {}
    for category in sorted(p for p in need(folder / RELEASE).iterdir() if p.is_dir()):
        qa = category / "questions_answers_YN" if (category / "images").is_dir() else category
        for txt in sorted(qa.glob("*.txt")):
            for line in txt.read_text().splitlines():
                if "\t" in line:
                    question, answer = line.strip().split("\t")
                    key[category.name, txt.name, question] = answer
    return key


def mme_question(prompt: str, category: str, file: str, key: dict) -> str:
    """The release's wording of a prompt: the short-answer instruction out, the yes/no one in (with the release's
    occasional double space)."""
    question = prompt.replace(SHORT_ANSWER, "").strip() if SHORT_ANSWER in prompt else prompt
    if YES_NO.strip() not in question:
        question += YES_NO
    if (category, file, question) not in key:
        question = question.replace(YES_NO, " " + YES_NO)
    return question


def yes_no(text: str) -> str:
    """convert_answer_to_mme's reading, then calculation.py's: ``yes`` / ``no`` / ``other``."""
    pred = text.strip().lower()
    pred = "yes" if pred.startswith("yes") else "no" if pred.startswith("no") else pred
    if pred in ("yes", "no"):
        return pred
    return "yes" if "yes" in pred[:4] else "no" if "no" in pred[:4] else "other"


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    key = answer_key(folder)
    right: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))  # category → image → questions
    unmatched = 0
    for _, answer in answered:
        if answer is None:
            continue
        category, name = str(answer["question_id"]).split("/")[0], str(answer["question_id"]).split("/")[-1]
        file = name.split(".")[0] + ".txt"
        question = mme_question(answer["prompt"], category, file, key)
        if (category, file, question) not in key:
            unmatched += 1  # the official conversion stops there; here it is counted
            continue
        right[category][file].append(yes_no(answer["text"]) == key[category, file, question].lower())
    subtasks = {}
    for category, images in sorted(right.items()):
        flat = [r for rs in images.values() for r in rs]
        # acc: per question; acc+: per image, both of its questions right (the official pairs)
        acc, acc_plus = 100 * sum(flat) / len(flat), 100 * sum(all(rs) for rs in images.values()) / len(images)
        subtasks[category] = {"acc": acc, "acc_plus": acc_plus, "score": acc + acc_plus, "n": len(flat)}
    totals = {name: sum(subtasks[c]["score"] for c in group if c in subtasks)
              for name, group in (("perception", PERCEPTION), ("cognition", COGNITION))}  # fmt: skip
    return {**totals, "subtasks": subtasks, "unmatched": unmatched}
