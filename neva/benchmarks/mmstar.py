"""MMStar (val): the option letter, per category and on average, as lmms-eval 0.7.3 scores ``mmstar``
(``lmms_eval/tasks/mmstar/utils.py``).

Files: the Hugging Face snapshot of ``Lin-Chen/MMStar``: ``mmstar.parquet`` (or ``val-*.parquet``), columns
``index``, ``question`` (its options and the image in it), ``image``, ``answer`` (a letter), ``category``,
``l2_category``.

Prompt (``mmstar.yaml``, ``default``): the question stripped, then ``\\nAnswer with the option's letter from the given
choices directly`` (no period, as the YAML writes it); the task sets no ``max_new_tokens``: lmms-eval's model
wrappers' default, 1024.

Scoring: the letter ``choice_letter.extract_choice`` reads among A-D equals the answer. Each category's score is the
mean over its ``l2_category`` means (lmms-eval's metric per category aggregates the category's questions by their
``l2_category``), ``average`` the same over all questions.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from neva.benchmarks.choice_letter import extract_choice
from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean_stderr

POST_PROMPT = "\nAnswer with the option's letter from the given choices directly"
YES_NO = " Please answer yes or no."  # removed from a question given a post prompt
CATEGORIES = ("coarse perception", "fine-grained perception", "instance reasoning", "logical reasoning",
              "science & technology", "math")  # fmt: skip
SCORED = ("index", "answer", "category", "l2_category")


def prompt(doc: dict[str, Any]) -> str:
    return doc["question"].strip().replace(YES_NO, "") + POST_PROMPT


def read(folder: Path) -> Read:
    read = Read([])
    for doc in read_rows(split_files(folder, "val", also=("mmstar.parquet",))):
        text = prompt(doc)
        read.questions.append(Question(doc["index"], text, text, (doc["image"],), meta={k: doc[k] for k in SCORED}))
    return read


def right(doc: dict[str, Any], text: str) -> float:
    return 1.0 if extract_choice(text, ("A", "B", "C", "D")) == doc["answer"].strip().upper() else 0.0


def l2_mean(items: list[tuple[str, float]]) -> float:
    """``mmstar_aggregate_results``: the mean of the per-``l2_category`` means."""
    groups: dict[str, list[float]] = defaultdict(list)
    for l2, s in items:
        groups[l2].append(s)
    return sum(sum(v) / len(v) for v in groups.values()) / len(groups)


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    items = [(doc["category"], doc["l2_category"], right(doc, text)) for doc, text in pairs]
    out: dict[str, Any] = {}
    for name in (*CATEGORIES, "average"):
        mine = [(l2, s) for c, l2, s in items if name in (c, "average")]
        if mine:
            out[name] = l2_mean(mine)
            out[f"{name}_stderr"] = mean_stderr([s for _, s in mine])
    return {**out, "n": len(items)}


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
