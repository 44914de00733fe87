"""The helpers that lay out a benchmark's files (the tiny checkpoint every benchmark test answers with is
``tests/conftest.py``'s)."""

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from neva.evaluate import main as evaluate_main
from tests.checkpoint.tiny_hf import one_thread

ANSWER_FIELDS = {"question_id", "prompt", "text", "answer_id", "model_id", "metadata"}
"""What model_vqa_loader writes per answer (the official scorers read question_id, prompt, text)."""


def draw(path: Path, seed: int = 0) -> Path:
    """A small random RGB image at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(path)
    return path


def write_jsonl(path: Path, records: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def run_suite(suite: str, checkpoint: Path, data_dir: Path, out: Path, capsys) -> tuple[dict, list[dict]]:
    """``neva.evaluate --suite SUITE`` (3 new tokens, batches of 4): its printed result and the answers it wrote."""
    try:
        with one_thread():
            evaluate_main(["--suite", suite, "--checkpoint", str(checkpoint), "--data-dir", str(data_dir),
                           "--output-dir", str(out), "--max-new-tokens", "3", "--batch-size", "4"])  # fmt: skip
    finally:
        torch.set_grad_enabled(True)  # evaluate turns autograd off for its process
    result = json.loads(capsys.readouterr().out)
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert json.loads((out / "scores.json").read_text())["suite"] == suite
    assert result["questions_per_s"] > 0 and result["max_new_tokens"] == 3
    return result, answers
