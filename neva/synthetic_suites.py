"""The built-in synthetic suites (``neva.evaluate --suite shapes|skills|detail|video``; ``model.eval.suites`` runs
them during training): exact-match accuracy on held-out generated questions, per kind or skill with 95 % Wilson
intervals, and the controls (another question's media; none). Each takes an ``Answerer`` (a checkpoint's, or the
training model's), a question count, the data seed and a batch size.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any

from neva.inference import Answerer, Item


def normalize(text: str) -> str:
    """Case-, space- and final-period-insensitive form for exact-match scoring."""
    return " ".join(text.strip().lower().rstrip(".").split())


def stripped_answers(answerer: Answerer, items: list[Item], batch_size: int) -> list[str]:
    """The answers to ``items``, stripped of surrounding white space (what the scorers compare)."""
    return [text.strip() for text in answerer.answer_all(items, batch_size)]


def evaluate_synthetic(answerer: Answerer, limit: int, seed: int, batch_size: int) -> dict[str, Any]:
    from neva.data.synthetic import synthetic_eval_records

    size = answerer.model.cfg.vision.image_size
    records = synthetic_eval_records(size, seed=seed, num_samples=limit)
    answers = stripped_answers(answerer, [(r.question, [r.image]) for r in records], batch_size)
    per_kind: dict[str, list[int]] = defaultdict(list)
    for record, answer in zip(records, answers):
        per_kind[record.kind].append(int(normalize(answer) == normalize(record.answer)))
    correct = sum(sum(v) for v in per_kind.values())
    return {
        "accuracy": correct / len(records),
        "n": len(records),
        "per_kind": {k: sum(v) / len(v) for k, v in sorted(per_kind.items())},
        "examples": [{"q": r.question, "expected": r.answer, "got": a} for r, a in list(zip(records, answers))[:5]],
    }


def evaluate_video(answerer: Answerer, limit: int, seed: int, batch_size: int) -> dict[str, Any]:
    """Exact-match accuracy on the held-out synthetic video clips (``neva.data.synthetic_video``), per question kind
    with its 95 % Wilson interval, chance and the controls (another clip; no clip); each clip decoded by the loader's
    decoder at the checkpoint's ``num_frames``."""
    from neva.data.synthetic_video import CHANCE, clip, default_folder, question_kind, video_records, write_videos

    records = video_records(seed, "val", limit, "qa")
    folder = default_folder(seed)
    write_videos(seed, records, folder)
    clips = [clip(seed, "val", i) for i in range(len(records))]
    kinds = [question_kind(i) for i in range(len(records))]
    items: list[Item] = [
        (c.question(kind), [], [answerer.read_video(os.path.join(folder, r["video"]))])
        for c, kind, r in zip(clips, kinds, records)
    ]
    right = correct_under_controls(answerer, items, [c.answer(k) for c, k in zip(clips, kinds)], batch_size)
    return {
        "suite": "video",
        **overall(right),
        "num_frames": answerer.video_limits.num_frames,
        "per_kind": accuracy_rows(right, kinds, CHANCE),
    }


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % for ``z`` 1.96): unlike ``p ± z·se`` it stays inside
    [0, 1] and is honest at 0 and 1 correct answers, where the canary's bands live."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


SKILL_CONDITIONS = ("image", "swapped", "no_image")
"""A suite's three feeds of each question: its own image(s) or video(s); those of the next held-out question with as
many (same prompt, wrong pixels); and none at all (the prompt without tags, as a text-only sample is trained, so
nothing is fed in the media's place). Where the answer depends on the media, the controls fall to chance."""


def correct_under_controls(
    answerer: Answerer, items: list[Item], answers: list[str], batch_size: int
) -> dict[str, list[bool]]:
    """Per ``SKILL_CONDITIONS`` feed, whether each item (bare prompt, images, videos) is answered exactly right."""
    media = [(list(item[1]), list(item[2]) if len(item) > 2 else []) for item in items]
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (images, videos) in enumerate(media):
        groups[len(images), len(videos)].append(i)
    swapped = list(range(len(items)))
    for group in groups.values():
        for pos, i in enumerate(group):
            swapped[i] = group[(pos + 1) % len(group)]
    feeds = {
        "image": [(item[0], *media[i]) for i, item in enumerate(items)],
        "swapped": [(item[0], *media[j]) for item, j in zip(items, swapped)],
        "no_image": [(item[0], [], []) for item in items],
    }
    return {
        name: [normalize(a) == normalize(b) for a, b in zip(stripped_answers(answerer, feed, batch_size), answers)]
        for name, feed in feeds.items()
    }


def overall(right: dict[str, list[bool]]) -> dict[str, Any]:
    """The whole suite's accuracy, question count and controls."""
    n = len(right["image"])
    return {
        "accuracy": sum(right["image"]) / n,
        "n": n,
        "controls": {c: sum(right[c]) / n for c in SKILL_CONDITIONS[1:]},
    }


def accuracy_rows(
    right: dict[str, list[bool]],
    labels: list[str],
    chance: dict[str, float],
    means: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """Per skill (``labels[i]``: question ``i``'s, in ``chance``'s order): its question count, accuracy with the 95 %
    Wilson interval, chance level, the mean of each per-question number in ``means``, and accuracy under each
    control."""
    rows: dict[str, Any] = {}
    for name, level in chance.items():
        idx = [i for i, label in enumerate(labels) if label == name]
        if not idx:
            continue
        correct = sum(right["image"][i] for i in idx)
        lo, hi = wilson_interval(correct, len(idx))
        rows[name] = {
            "n": len(idx),
            "accuracy": correct / len(idx),
            "ci95": [round(lo, 4), round(hi, 4)],
            "chance": round(level, 4),
            **{key: round(sum(values[i] for i in idx) / len(idx), 4) for key, values in (means or {}).items()},
            **{c: sum(right[c][i] for i in idx) / len(idx) for c in SKILL_CONDITIONS[1:]},
        }
    return rows


def evaluate_skills(answerer: Answerer, limit: int, seed: int, batch_size: int) -> dict[str, Any]:
    """Per-skill exact-match accuracy with 95 % Wilson intervals on the skills suite, the mean probability of each
    reference reply (``reply_prob``), and the two controls."""
    from neva.data.synthetic_skills import SKILLS, skills_eval_records

    records = skills_eval_records(answerer.model.cfg.vision.image_size, seed=seed, num_samples=limit)
    right = correct_under_controls(answerer, [(r.question, r.images) for r in records], [r.answer for r in records],
                                   batch_size)  # fmt: skip
    # Each reference reply's probability under teacher forcing: it keeps moving after a skill's accuracy saturates.
    scored = [(r.question, list(r.images), r.answer) for r in records]
    probs = [
        math.exp(-x)
        for k in range(0, len(scored), batch_size)
        for x in answerer.reply_losses(scored[k : k + batch_size])
    ]
    chance = {name: skill.chance for name, skill in SKILLS.items()}
    skills = accuracy_rows(right, [r.skill for r in records], chance, {"reply_prob": probs})
    return {"suite": "skills", **overall(right), "reply_prob": round(sum(probs) / len(probs), 4), "skills": skills}


BAND_METRICS = ("accuracy", "reply_prob")
"""What the quality canary's bands bound, for the whole suite and per skill (``tests/training/canary_bands.json``)."""


def outside_bands(result: dict[str, Any], bands: dict[str, Any]) -> dict[str, tuple[float, list[float]]]:
    """``"{skill} {metric}"`` → ``(value, band)`` for each number of an ``evaluate_skills`` result outside its band
    (``bands``: ``{"overall": {metric: [low, high]}, "skills": {skill: {metric: [low, high]}}}``); empty when every
    number is inside. A skill the bands name but the result lacks counts as outside."""
    values = {"overall": result, **result["skills"]}
    outside = {}
    for name, limits in {"overall": bands["overall"], **bands["skills"]}.items():
        for metric, (low, high) in limits.items():
            value = values.get(name, {}).get(metric, math.nan)
            if not low <= value <= high:
                outside[f"{name} {metric}"] = (value, [low, high])
    return outside


def evaluate_detail(answerer: Answerer, limit: int, seed: int, batch_size: int) -> dict[str, Any]:
    """Exact-match accuracy with its 95 % Wilson interval and the controls (another image; none) on the detail set
    (``neva.data.synthetic_detail``), the images at full size (a fixed-resolution checkpoint downscales them, an
    AnyRes one tiles them)."""
    from neva.data.synthetic_detail import PATTERNS, detail_eval_items

    items = detail_eval_items(answerer.model.cfg.vision.image_size, seed=seed, num_samples=limit)
    right = correct_under_controls(answerer, [(q, [image]) for q, image, _ in items], [a for _, _, a in items],
                                   batch_size)  # fmt: skip
    (row,) = accuracy_rows(right, ["detail"] * len(items), {"detail": 1 / len(PATTERNS)}).values()
    return {
        "suite": "detail",
        **overall(right),
        "ci95": row["ci95"],
        "chance": row["chance"],
        "anyres": answerer.model.cfg.anyres is not None,
    }


SUITES = {
    "shapes": (evaluate_synthetic, 200),
    "skills": (evaluate_skills, 1000),
    "detail": (evaluate_detail, 300),
    "video": (evaluate_video, 200),
}
