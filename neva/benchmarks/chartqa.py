"""ChartQA (test): relaxed accuracy overall and on the human and augmented splits, as lmms-eval 0.7.3 scores
``chartqa`` (``lmms_eval/tasks/chartqa/utils.py``; ``relaxed_correctness`` from Qwen-VL's ``evaluate_vqa.py``).

Files: the Hugging Face snapshot of ``lmms-lab/ChartQA``: ``test`` parquet files, columns ``type`` (``human_test`` /
``augmented_test``), ``question``, ``answer``, ``image``.

Prompt (``chartqa.yaml``, ``default``): the question, then ``\\nAnswer the question with a single word.``; 16 new
tokens.

Relaxed accuracy: when the answer and the reference both read as numbers (``float``; a trailing ``%`` divides by 100)
and the reference is not 0, right within 5 % of the reference; otherwise right when equal ignoring case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean, mean_stderr

POST_PROMPT = "\nAnswer the question with a single word."
MAX_RELATIVE_CHANGE = 0.05


def prompt(doc: dict[str, Any]) -> str:
    return f"{doc['question']}{POST_PROMPT}"


def read(folder: Path) -> Read:
    read = Read([])
    for i, doc in enumerate(read_rows(split_files(folder, "test"))):
        text = prompt(doc)
        meta = {"type": doc["type"], "answer": doc["answer"]}
        read.questions.append(Question(i, text, text, (doc["image"],), meta=meta))
    return read


def as_number(text: str) -> float | None:
    try:
        return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed_correct(prediction: str, target: str) -> bool:
    mine, gold = as_number(prediction), as_number(target)
    if mine is not None and gold:
        return abs(mine - gold) / abs(gold) <= MAX_RELATIVE_CHANGE
    return prediction.lower() == target.lower()


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    scored = [(doc["type"], float(relaxed_correct(text, doc["answer"]))) for doc, text in pairs]
    groups = {"relaxed_overall": [s for _, s in scored],
              "relaxed_human_split": [s for t, s in scored if t == "human_test"],
              "relaxed_augmented_split": [s for t, s in scored if t != "human_test"]}  # fmt: skip
    out: dict[str, Any] = {}
    for name, scores in groups.items():
        out[name], out[f"{name}_stderr"] = mean(scores), mean_stderr(scores)
    return {**out, "n": len(scored)}


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
