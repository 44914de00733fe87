"""GQA (testdev balanced): exact-match accuracy, overall and per question type, as GQA's ``eval.py`` computes it on
the predictions LLaVA's ``scripts/convert_gqa_for_eval.py`` writes (``text`` without its final periods, lower-cased).

Layout (``gqa/``): ``llava_gqa_testdev_balanced.jsonl``, ``data/testdev_balanced_questions.json`` (question id →
``answer``, ``types``) and ``data/images/``. Writes ``testdev_balanced_predictions.json`` (``questionId``,
``prediction``) for the official script; its consistency, validity, plausibility and grounding need assets not
listed here and are left to it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read, load_json, need, vqa_loader_questions


def read(folder: Path) -> Read:
    return vqa_loader_questions(
        folder / "llava_gqa_testdev_balanced.jsonl",
        folder / "data" / "images",
        scorer_files=(folder / "data" / "testdev_balanced_questions.json",),
    )


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    truth = load_json(need(folder / "data" / "testdev_balanced_questions.json"))
    predictions = [{"questionId": a["question_id"], "prediction": a["text"].rstrip(".").lower()}
                   for _, a in answered if a is not None]  # fmt: skip
    (out / "testdev_balanced_predictions.json").write_text(json.dumps(predictions))
    right, per_type = [], defaultdict(list)
    for p in predictions:
        q = truth.get(str(p["questionId"]))
        if q is None:
            continue
        ok = p["prediction"] == q["answer"]
        right.append(ok)
        for kind in ("structural", "semantic"):
            if kind in q.get("types", {}):
                per_type[f"{kind}:{q['types'][kind]}"].append(ok)
    return {
        "accuracy": 100 * sum(right) / len(right) if right else 0.0, "n": len(right),
        "per_type": {k: 100 * sum(v) / len(v) for k, v in sorted(per_type.items())},
        "predictions_file": str(out / "testdev_balanced_predictions.json"),
    }  # fmt: skip
