"""POPE (object hallucination, COCO): yes/no answers scored per split as LLaVA's ``llava/eval/eval_pope.py`` does.

Layout (``pope/``): ``llava_pope_test.jsonl`` (``question_id``, ``image``, ``text``, ``category``: the split),
``coco/coco_pope_{adversarial,popular,random}.json`` (one JSON line per question with its ``label``, in the question
file's order within the split: the official script pairs answers and labels by position) and ``val2014/`` images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read, load_jsonl, need, vqa_loader_questions

SPLIT_FILE = "coco_pope_{}.json"


def read(folder: Path) -> Read:
    return vqa_loader_questions(
        folder / "llava_pope_test.jsonl", folder / "val2014", ("category",), scorer_files=(folder / "coco",)
    )


def says_yes(text: str) -> bool:
    """The official reading: the first sentence, commas dropped, is a no when one of its words is No, no or not."""
    words = text.split(".")[0].replace(",", "").split(" ")
    return not {"No", "no", "not"} & set(words)


def confusion_scores(pairs: list[tuple[bool, bool]]) -> dict[str, Any]:
    """``(predicted yes, labelled yes)`` pairs → the official five numbers (a ratio whose denominator is 0 is 0: the
    official script divides by zero there)."""
    tp = sum(p and y for p, y in pairs)
    fp = sum(p and not y for p, y in pairs)
    tn = sum(not p and not y for p, y in pairs)
    fn = sum(not p and y for p, y in pairs)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    n = len(pairs)
    return {
        "accuracy": (tp + tn) / n if n else 0.0, "precision": precision, "recall": recall, "f1": f1,
        "yes_ratio": (tp + fp) / n if n else 0.0, "n": n, "TP": tp, "FP": fp, "TN": tn, "FN": fn,
    }  # fmt: skip


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for path in sorted(need(folder / "coco").glob(SPLIT_FILE.format("*"))):
        split = path.name[len("coco_pope_") : -len(".json")]
        labels = [r["label"] for r in load_jsonl(path) if isinstance(r, dict)]
        mine = [a for q, a in answered if q.meta.get("category") == split]
        # By position, as the official script pairs them; a skipped question drops its label with it.
        pairs = [(says_yes(a["text"]), label != "no") for a, label in zip(mine, labels) if a is not None]
        splits[split] = confusion_scores(pairs)
    if not splits:  # no split file at all: name one
        need(folder / "coco" / SPLIT_FILE.format("random"))
    mean = {k: sum(s[k] for s in splits.values()) / len(splits) for k in ("accuracy", "f1")}
    return {"splits": splits, "mean_accuracy": mean["accuracy"], "mean_f1": mean["f1"]}
