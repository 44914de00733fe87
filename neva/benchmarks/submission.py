"""VQAv2 (test-dev) and VizWiz (test): no answers to score against, only the EvalAI servers' upload files, written as
LLaVA's ``scripts/convert_vqav2_for_submission.py`` / ``convert_vizwiz_for_submission.py`` write them (each answer
normalised by ``normalize_vqa_answer``).

Layouts: ``vqav2/llava_vqav2_mscoco_test-dev2015.jsonl`` (asked), ``vqav2/llava_vqav2_mscoco_test2015.jsonl`` (the
whole test split the server expects; a question not asked gets ``""``), ``vqav2/test2015/``;
``vizwiz/llava_test.jsonl``, ``vizwiz/test/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read, load_jsonl, need, vqa_loader_questions
from neva.benchmarks.vqa_normalize import normalize_vqa_answer


def read_vqav2(folder: Path) -> Read:
    return vqa_loader_questions(
        folder / "llava_vqav2_mscoco_test-dev2015.jsonl",
        folder / "test2015",
        scorer_files=(folder / "llava_vqav2_mscoco_test2015.jsonl",),
    )


def score_vqav2(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    texts = {a["question_id"]: a["text"] for _, a in answered if a is not None}
    split = [r for r in load_jsonl(need(folder / "llava_vqav2_mscoco_test2015.jsonl")) if isinstance(r, dict)]
    upload = [{"question_id": r["question_id"], "answer": normalize_vqa_answer(texts.get(r["question_id"], ""))}
              for r in split]  # fmt: skip
    return _write(out / "vqav2_upload.json", upload, len(texts))


def read_vizwiz(folder: Path) -> Read:
    return vqa_loader_questions(folder / "llava_test.jsonl", folder / "test", ("image",))


def score_vizwiz(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    # Every question of the split, by its image (a skipped one answers "": the official script would stop)
    upload = [{"image": q.meta["image"], "answer": normalize_vqa_answer(a["text"] if a else "")} for q, a in answered]
    return _write(out / "vizwiz_upload.json", upload, sum(a is not None for _, a in answered))


def _write(path: Path, upload: list[dict], answered: int) -> dict[str, Any]:
    path.write_text(json.dumps(upload))
    return {"upload_file": str(path), "n": len(upload), "answered": answered}
