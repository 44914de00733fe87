"""``python -m neva.evaluate``: accuracy on the held-out synthetic set, or answers for VQA question files.

- No arguments: the default fine-tune output (``outputs/finetune/final``) on the synthetic held-out split; prints one
  JSON line with ``accuracy``, ``n`` and per-question-kind accuracy.
- ``--checkpoint CKPT``: another neva checkpoint.
- ``--input-file q.jsonl --output-file a.jsonl``: LLaVA ``model_vqa``-style question records
  (``{"question_id", "image", "text"}``; ``prompt`` is accepted for ``text``) answered greedily; answers are written as
  ``{"question_id", "prompt", "text", "model_id"}`` (what the LLaVA / lmms scorers read). Records carrying an
  ``answer`` get exact-match scored too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.neva_format import is_neva_checkpoint, refuse_nemo_checkpoint
from neva.checkpoint.step import is_step_checkpoint
from neva.inference import Answerer, Item, read_jsonl, record_image_paths
from neva.models.generation import GenerationConfig
from neva.typed import exit_on_config_error


def default_checkpoint() -> str:
    return os.path.join(os.environ.get("NEVA_OUTPUT_ROOT", "outputs"), "finetune", "final")


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


def evaluate_file(
    answerer: Answerer, input_file: Path, output_file: Path, image_folder: Path | None, model_id: str, batch_size: int
) -> dict[str, Any]:
    records = read_jsonl(input_file)
    root = image_folder or input_file.parent
    items = [(r.get("text", r.get("prompt", "")), record_image_paths(r, root)) for r in records]
    answers = stripped_answers(answerer, items, batch_size)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    scored = [(a, r["answer"]) for a, r in zip(answers, records) if "answer" in r]
    with open(output_file, "w") as f:
        for r, (prompt, _), a in zip(records, items, answers):
            out = {"question_id": r.get("question_id", r.get("id")), "prompt": prompt, "text": a}
            f.write(json.dumps({**out, "model_id": model_id}) + "\n")
    result: dict[str, Any] = {"n": len(records), "output_file": str(output_file)}
    if scored:
        result["accuracy"] = sum(normalize(a) == normalize(str(g)) for a, g in scored) / len(scored)
        result["n_scored"] = len(scored)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="neva checkpoint (default: the default fine-tune output)")
    parser.add_argument("--input-file", type=Path, help="VQA question records (jsonl)")
    parser.add_argument("--output-file", type=Path, help="where answers go (with --input-file)")
    parser.add_argument("--image-folder", type=Path, help="images of --input-file (default: its folder)")
    parser.add_argument("--template", default=None, help="conversation template (default: the checkpoint's)")
    parser.add_argument("--limit", type=int, default=200, help="synthetic held-out questions to ask")
    parser.add_argument("--seed", type=int, default=0, help="synthetic data seed (as model.data.synthetic_seed)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=50)
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint or default_checkpoint()
    with exit_on_config_error():
        refuse_nemo_checkpoint(checkpoint, "--checkpoint")
    if not is_neva_checkpoint(checkpoint) and not is_step_checkpoint(checkpoint):
        sys.exit(
            f"no neva checkpoint at {checkpoint}: run `python -m neva.train +stage=pretrain` and "
            "`python -m neva.train +stage=finetune` first, or pass --checkpoint"
        )
    if (args.input_file is None) != (args.output_file is None):
        sys.exit("--input-file and --output-file go together")
    torch.set_grad_enabled(False)
    with exit_on_config_error():
        answerer = Answerer(
            checkpoint,
            GenerationConfig(max_new_tokens=args.max_new_tokens),
            template=args.template,
            dtype=torch.float32,
        )
    if args.input_file is not None:
        name = Path(checkpoint).name
        result = evaluate_file(answerer, args.input_file, args.output_file, args.image_folder, name, args.batch_size)
    else:
        result = evaluate_synthetic(answerer, args.limit, args.seed, args.batch_size)
    result["checkpoint"] = str(Path(checkpoint).resolve())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
