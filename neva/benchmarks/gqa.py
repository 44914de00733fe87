"""GQA (testdev balanced): exact-match accuracy, overall and per question type, as GQA's ``eval.py`` computes it on
the predictions LLaVA's ``scripts/convert_gqa_for_eval.py`` writes (``text`` without its final periods, lower-cased).

Layout (``gqa/``): ``llava_gqa_testdev_balanced.jsonl``, ``data/testdev_balanced_questions.json`` (question id →
``answer``, ``types``) and ``data/images/``. Writes ``testdev_balanced_predictions.json`` (``questionId``,
``prediction``) for the official script. The official script's other metrics too, where the files allow
(``official_metrics``); grounding (attention maps) is not.
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
    choices_file = folder / "data" / CHOICES_FILE
    choices = load_json(choices_file) if choices_file.exists() else None
    return {
        **official_metrics(truth, {str(p["questionId"]): p["prediction"] for p in predictions}, choices),
        "predictions_file": str(out / "testdev_balanced_predictions.json"),
    }


CHOICES_FILE = "testdev_balanced_choices.json"
"""Question id → ``valid`` / ``plausible`` answers: what validity and plausibility need (GQA's v1.2 release has none
for testdev; where the file is there, they are computed)."""


def steps(question: dict[str, Any]) -> int:
    """``eval.py``'s ``getStepsNum``: the question's program steps, not counting its final query of a name or an
    existence check."""
    return len([c for c in question.get("semantic", [])
                if not any(o in f"{c['operation']}: {c['argument']}" for o in ("exist", "query: name", "choose name"))])  # fmt: skip


def belongs(answer: str, group: list[str], question: dict[str, Any]) -> bool:
    """``eval.py``'s ``belongs``: a "Common" question's valid / plausible group is colour, material, shape."""
    if "Common" in question.get("types", {}).get("detailed", ""):
        group = ["color", "material", "shape"]
    return answer in group


def chi_square(gold: dict[str, dict[str, int]], predicted: dict[str, dict[str, int]]) -> float:
    """``eval.py``'s ``chiSquare``: per answer group, the chi-square statistic of the predicted answer counts against
    the gold ones, weighted by the group's size (0 with no group: the official script divides by zero)."""
    total, weight = 0.0, 0
    for group, answers in gold.items():
        statistic = sum((predicted[group].get(a, 0) - e) ** 2 / e for a, e in answers.items())
        size = sum(answers.values())
        total += statistic * size
        weight += size
    return total / weight if weight else 0.0


def official_metrics(
    truth: dict[str, Any], predictions: dict[str, str], choices: dict[str, Any] | None
) -> dict[str, Any]:
    """GQA's ``eval.py`` over the balanced questions answered (question id → prediction): accuracy, binary (not a
    ``query``) and open accuracy, consistency (over each correctly answered question's entailed questions that were
    answered; ``eval.py --consistency`` insists on predictions for all of them), validity and plausibility (with
    ``choices``), the distribution score (chi-square / 100, lower is better) and accuracy per structural / semantic
    type, per reasoning steps and per question length in words. Percentages, as ``eval.py`` prints them."""
    lists: dict[str, list[float]] = defaultdict(list)
    detailed: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    gold: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    guessed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    missing_entailed = 0
    for qid, predicted in predictions.items():
        q = truth.get(qid)
        if q is None or not q.get("isBalanced", True):
            continue
        correct = float(predicted == q["answer"])
        lists["accuracy"].append(correct)
        types = q.get("types", {})
        lists["open" if types.get("structural") == "query" else "binary"].append(correct)
        for kind in ("structural", "semantic"):
            if kind in types:
                detailed[kind][types[kind]].append(correct)
        if "semantic" in q:
            detailed["steps"][steps(q)].append(correct)
        if "question" in q:
            detailed["words"][len(q["question"].split())].append(correct)
        if choices is not None and qid in choices:
            lists["validity"].append(float(belongs(predicted, choices[qid]["valid"], q)))
            lists["plausibility"].append(float(belongs(predicted, choices[qid]["plausible"], q)))
        group = q.get("groups", {}).get("global")
        if group is not None:
            gold[group][q["answer"]] += 1
            guessed[group][predicted] += 1
        entailed = [e for e in q.get("entailed", []) if e != qid]
        if correct and entailed:
            known = [e for e in entailed if e in predictions and e in truth]
            missing_entailed += len(entailed) - len(known)
            if known:
                lists["consistency"].append(_mean([float(predictions[e] == truth[e]["answer"]) for e in known]))

    def pct(values: list[float]) -> float:
        return 100 * _mean(values)

    out: dict[str, Any] = {"accuracy": pct(lists["accuracy"]), "n": len(lists["accuracy"]),
                           "binary": pct(lists["binary"]), "open": pct(lists["open"])}  # fmt: skip
    if lists["consistency"] or missing_entailed:
        out["consistency"] = pct(lists["consistency"])
        out["consistency_missing_entailed"] = missing_entailed
    if choices is not None:
        out["validity"], out["plausibility"] = pct(lists["validity"]), pct(lists["plausibility"])
    if gold:
        out["distribution"] = chi_square(gold, guessed) / 100
    # per_type keeps its earlier keys (structural:verify, semantic:attr)
    out["per_type"] = {f"{kind}:{t}": pct(v) for kind in ("structural", "semantic")
                       for t, v in sorted(detailed[kind].items())}  # fmt: skip
    for kind in ("steps", "words"):
        if detailed[kind]:
            out[f"per_{kind}"] = {str(t): pct(v) for t, v in sorted(detailed[kind].items())}
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
