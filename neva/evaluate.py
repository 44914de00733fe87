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
from PIL import Image

from neva.checkpoint.neva_format import is_neva_checkpoint, load_metadata, load_model, load_tokenizer
from neva.generate import PromptBuilder, decode_answer
from neva.models.generation import GenerationConfig, generate


def default_checkpoint() -> str:
    return os.path.join(os.environ.get("NEVA_OUTPUT_ROOT", "outputs"), "finetune", "final")


def normalize(text: str) -> str:
    """Case-, space- and final-period-insensitive form for exact-match scoring."""
    return " ".join(text.strip().lower().rstrip(".").split())


class Answerer:
    """Greedy answers for (images, question) pairs with one checkpoint, in batches."""

    def __init__(self, checkpoint: str, template: str | None, max_new_tokens: int, batch_size: int) -> None:
        meta = load_metadata(checkpoint)
        self.model = load_model(checkpoint, dtype=torch.float32)
        self.tokenizer = load_tokenizer(checkpoint)
        self.builder = PromptBuilder(self.tokenizer, self.model.cfg, template or meta.get("conv_template", "vicuna_v1"))
        from neva.data.images import ImageProcessor

        vision = self.model.cfg.vision
        self.process = ImageProcessor(vision, meta.get("image_aspect_ratio", "square")) if vision else None
        pad = self.tokenizer.pad_token_id
        self.gen = GenerationConfig(
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.builder.eos_ids(),
            stop_strings=self.builder.stop_strings(),
            pad_token_id=0 if pad is None or pad == self.model.cfg.image_token_id else pad,
        )
        self.batch_size = batch_size

    def __call__(self, items: list[tuple[list[Image.Image], str]]) -> list[str]:
        answers: list[str] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            prompts = [self.builder.ids(q, len(images)) for images, q in chunk]
            pixels = [self.process(im) for images, _ in chunk for im in images]
            out = generate(
                self.model,
                prompts,
                torch.stack(pixels) if pixels else None,
                [len(images) for images, _ in chunk],
                self.gen,
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            )
            answers += [decode_answer(self.tokenizer, ids, self.gen.stop_strings).strip() for ids in out]
        return answers


def evaluate_synthetic(answerer: Answerer, limit: int, seed: int) -> dict[str, Any]:
    from neva.data.synthetic import synthetic_eval_records

    size = answerer.model.cfg.vision.image_size
    records = synthetic_eval_records(size, seed=seed, num_samples=limit)
    answers = answerer([([r.image], r.question) for r in records])
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


def evaluate_file(answerer: Answerer, input_file: Path, output_file: Path, image_folder: Path | None, model_id: str):
    records = [json.loads(line) for line in input_file.read_text().splitlines() if line.strip()]
    root = image_folder or input_file.parent
    items = []
    for r in records:
        names = r.get("image") or []
        names = [names] if isinstance(names, str) else names
        images = []
        for name in names:
            with Image.open(root / name) as im:
                images.append(im.convert("RGB"))
        items.append((images, r.get("text", r.get("prompt", ""))))
    answers = answerer(items)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    scored = [(a, r["answer"]) for a, r in zip(answers, records) if "answer" in r]
    with open(output_file, "w") as f:
        for r, a in zip(records, answers):
            out = {"question_id": r.get("question_id", r.get("id")), "prompt": items[records.index(r)][1], "text": a}
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
    if not is_neva_checkpoint(checkpoint):
        sys.exit(
            f"no neva checkpoint at {checkpoint}: run `python -m neva.train +stage=pretrain` and "
            "`python -m neva.train +stage=finetune` first, or pass --checkpoint"
        )
    if (args.input_file is None) != (args.output_file is None):
        sys.exit("--input-file and --output-file go together")
    torch.set_grad_enabled(False)
    answerer = Answerer(checkpoint, args.template, args.max_new_tokens, args.batch_size)
    if args.input_file is not None:
        result = evaluate_file(answerer, args.input_file, args.output_file, args.image_folder, Path(checkpoint).name)
    else:
        result = evaluate_synthetic(answerer, args.limit, args.seed)
    result["checkpoint"] = str(Path(checkpoint).resolve())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
