"""HallusionBench (image split): aAcc, qAcc, fAcc by lmms-eval 0.7.3's rule-based scorer
(``lmms_eval/tasks/hallusion_bench/evaluate_hb.py``, ``hb_aggregation_result_*_intern``).

lmms-eval's ``hallusion_bench_image`` task asks GPT-4 whether each answer agrees with the reference by default; that
judge is not run here (no network, and a paid model is no reproducible scorer): the output says ``judge: none``.
The rule-based scorer reads an answer as yes when ``yes`` appears anywhere in it (lower-cased), else no.

Files: the Hugging Face snapshot of ``lmms-lab/HallusionBench``: ``image`` parquet files, columns ``category``
(``VD`` / ``VS``), ``subcategory``, ``set_id``, ``figure_id``, ``question_id``, ``question``, ``gt_answer`` (``1``
yes / ``0`` no), ``image``.

Prompt (``hallusion_bench_image.yaml``, ``default``): the question, nothing added; 128 new tokens.

Metrics (fractions, as the rule-based aggregation returns them): aAcc, over questions; qAcc, over questions asked of
several figures (category, subcategory, set, question): right only when right for every figure; fAcc, over figures
(category, subcategory, set, figure): right only when every question about it is right.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean, mean_stderr

SCORED = ("category", "subcategory", "set_id", "figure_id", "question_id", "gt_answer")


def prompt(doc: dict[str, Any]) -> str:
    return doc["question"]


def read(folder: Path) -> Read:
    read = Read([])
    for i, doc in enumerate(read_rows(split_files(folder, "image"))):
        text = prompt(doc)
        read.questions.append(Question(i, text, text, (doc["image"],), meta={k: doc[k] for k in SCORED}))
    return read


def says_yes(text: str) -> str:
    return "1" if "yes" in text.lower() else "0"


def grouped(items: list[tuple[dict[str, Any], bool]], last: str) -> list[float]:
    """1 per group of (category, subcategory, set, ``last``) whose questions are all right, else 0."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for doc, ok in items:
        groups["_".join([doc["category"], doc["subcategory"], str(doc["set_id"]), str(doc[last])])].append(ok)
    return [float(all(v)) for v in groups.values()]


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    items = [(doc, says_yes(text) == str(doc["gt_answer"])) for doc, text in pairs]
    per = {"aAcc": [float(ok) for _, ok in items], "qAcc": grouped(items, "question_id"),
           "fAcc": grouped(items, "figure_id")}  # fmt: skip
    out: dict[str, Any] = {}
    for name, scores in per.items():
        out[name], out[f"{name}_stderr"] = mean(scores), mean_stderr(scores)
    return {**out, "n": len(items), "judge": "none (rule: 'yes' in the answer; lmms-eval's default asks GPT-4)"}


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
