"""SEED-Bench: accuracy per question type and over image / video questions, as LLaVA's
``scripts/convert_seed_for_submission.py`` computes it (the answer text must equal the answer letter), plus its
upload file.

Layout (``seed_bench/``): ``llava-seed-bench.jsonl`` (``image`` relative to the folder: ``SEED-Bench-image/…`` or a
video's middle frame in ``SEED-Bench-video-image/…``) and ``SEED-Bench.json`` (``questions``: ``question_id``,
``answer``, ``question_type_id``, ``data_type``; ``question_type``: name → id).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read, load_json, need, vqa_loader_questions


def read(folder: Path) -> Read:
    return vqa_loader_questions(folder / "llava-seed-bench.jsonl", folder, scorer_files=(folder / "SEED-Bench.json",))


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    data = load_json(need(folder / "SEED-Bench.json"))
    names = {v: k for k, v in data["question_type"].items()}
    texts = {str(a["question_id"]): a["text"] for _, a in answered if a is not None}
    per_type, per_data = defaultdict(list), defaultdict(list)
    upload = []
    for q in data["questions"]:
        text = texts.get(str(q["question_id"]))  # unanswered: wrong, as officially
        per_type[names.get(q["question_type_id"], str(q["question_type_id"]))].append(text == q["answer"])
        per_data[q.get("data_type", "image")].append(text == q["answer"])
        if text is not None:
            upload.append({"question_id": q["question_id"], "prediction": text})
    (out / "seed_upload.jsonl").write_text("".join(json.dumps(u) + "\n" for u in upload))
    everything = [ok for v in per_type.values() for ok in v]
    return {
        "accuracy": 100 * sum(everything) / len(everything) if everything else 0.0, "n": len(everything),
        **{f"{kind}_accuracy": 100 * sum(v) / len(v) for kind, v in sorted(per_data.items())},
        "per_type": {k: 100 * sum(v) / len(v) for k, v in sorted(per_type.items())},
        "upload_file": str(out / "seed_upload.jsonl"),
    }  # fmt: skip
