"""RealWorldQA (test): exact match, as lmms-eval 0.7.3 scores ``realworldqa``
(``lmms_eval/tasks/realworldqa/utils.py``).

Files: the Hugging Face snapshot of ``lmms-lab/RealWorldQA`` (or ``xai-org/RealworldQA``): ``test`` parquet files,
columns ``question`` (its options and instruction in it), ``answer``, ``image``.

Prompt (``realworldqa.yaml``, ``default``): the question stripped, nothing added (its own instruction kept); 16 new
tokens.

Scoring: where the answer is a letter A-D, the letter ``choice_letter.extract_choice`` reads from the answer must equal
it; otherwise the answer lower-cased, stripped and without trailing periods must equal the reference lower-cased.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neva.benchmarks.choice_letter import extract_choice
from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean, mean_stderr

LETTERS = ("A", "B", "C", "D")


def prompt(doc: dict[str, Any]) -> str:
    return doc["question"].strip()


def read(folder: Path) -> Read:
    read = Read([])
    for i, doc in enumerate(read_rows(split_files(folder, "test"))):
        text = prompt(doc)
        read.questions.append(Question(i, text, text, (doc["image"],), meta={"answer": doc["answer"]}))
    return read


def right(doc: dict[str, Any], text: str) -> float:
    gold = doc["answer"].strip()
    if gold.upper() in LETTERS:
        return 1.0 if extract_choice(text, LETTERS) == gold.upper() else 0.0
    return 1.0 if text.lower().strip().rstrip(".") == gold.lower() else 0.0


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    scores = [right(doc, text) for doc, text in pairs]
    return {"exact_match": mean(scores), "exact_match_stderr": mean_stderr(scores), "n": len(scores)}


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
