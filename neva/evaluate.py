"""``python -m neva.evaluate``: accuracy on the held-out synthetic set, or answers for VQA question files.

- No arguments: the default fine-tune output (``outputs/finetune/final``) on the synthetic held-out split; prints one
  JSON line with ``accuracy``, ``n`` and per-question-kind accuracy.
- ``--checkpoint CKPT``: another neva checkpoint.
- ``--suite skills``: the skills suite (``neva.data.synthetic_skills``, the quality canary's): per-skill accuracy with
  95 % Wilson intervals, the mean probability of the reference reply under teacher forcing (``reply_prob``), and the
  same questions with another question's image(s) and with none (``SKILL_CONDITIONS``).
- ``--suite detail``: the detail set (``neva.data.synthetic_detail``): accuracy with its 95 % Wilson interval and the
  same controls, for comparing an AnyRes run with a fixed-resolution one.
- ``--suite video``: the synthetic video clips' held-out questions (``neva.data.synthetic_video``), per kind, with
  intervals and the same controls (another clip; none).
- ``--input-file q.jsonl --output-file a.jsonl``: LLaVA ``model_vqa``-style question records
  (``{"question_id", "image", "text"}``; ``prompt`` is accepted for ``text``) answered greedily; answers are written as
  ``{"question_id", "prompt", "text", "model_id"}`` (what the LLaVA / lmms scorers read). Records carrying an
  ``answer`` get exact-match scored too.
- ``--suite pope|textvqa|scienceqa|mme|mmbench|gqa|seed|vqav2|vizwiz --data-dir DIR --output-dir OUT``: a LLaVA-1.5
  benchmark read from LLaVA's ``playground/data/eval`` layout, answered as its scripts ask (``neva.benchmarks``;
  ``docs/EVALUATION.md``): ``OUT/answers.jsonl`` in ``model_vqa_loader``'s format, the official scores (one JSON line,
  and ``OUT/scores.json``), questions/s. ``--score ANSWERS_FILE`` scores an answers file written before (no model).
- ``--suite mmmu|mmstar|ai2d|ai2d_no_mask|ocrbench|docvqa|infovqa|chartqa|realworldqa|hallusionbench|mathvista|
  videomme|videomme_w_subtitle|...``: a benchmark of current model cards read from its Hugging Face dataset snapshot
  (parquet), asked and scored as lmms-eval 0.7.3 asks and scores it, a standard error beside each score.
- ``--suite mmmu,ocrbench,...``: several benchmarks, one model load; each writes ``OUT/<benchmark>/``, the printed
  table has one line per benchmark (and ``OUT/scores.json`` holds every result).
- ``--checkpoint HF_DIR``: a downloaded llava-hf or Qwen2-VL / Qwen2.5-VL / Qwen3-VL directory, imported in memory
  as ``neva.convert hf-to-neva`` imports it (nothing written), answered by the same harness.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from neva.benchmarks.run import load_benchmark, run_benchmark, score_answers
from neva.benchmarks.table import BENCHMARKS
from neva.checkpoint.hf_in_memory import is_hf_model_dir, load_hf_model
from neva.checkpoint.neva_format import (
    is_neva_checkpoint,
    load_metadata,
    load_model,
    load_tokenizer,
    refuse_nemo_checkpoint,
)
from neva.checkpoint.step import as_neva_checkpoint, is_step_checkpoint
from neva.errors import ConfigError, entry_point
from neva.inference import Answerer, read_jsonl, record_image_paths
from neva.models.generation import GenerationConfig

# The synthetic suites live in their own module (model.eval runs them during training too); their names stay
# importable from here, where the canary and the tests have always found them.
from neva.synthetic_suites import (  # noqa: F401
    BAND_METRICS,
    SKILL_CONDITIONS,
    SUITES,
    accuracy_rows,
    correct_under_controls,
    normalize,
    outside_bands,
    stripped_answers,
    wilson_interval,
)


def default_checkpoint() -> str:
    return os.path.join(os.environ.get("NEVA_OUTPUT_ROOT", "outputs"), "finetune", "final")


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


@entry_point
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="neva checkpoint, a run's step checkpoint, or an HF llava-hf / Qwen-VL model directory (default: the "
        "default fine-tune output)",
    )
    parser.add_argument("--input-file", type=Path, help="VQA question records (jsonl)")
    parser.add_argument("--output-file", type=Path, help="where answers go (with --input-file)")
    parser.add_argument("--image-folder", type=Path, help="images of --input-file (default: its folder)")
    parser.add_argument("--template", default=None, help="conversation template (default: the checkpoint's)")
    parser.add_argument(
        "--suite",
        default="shapes",
        help="a benchmark (docs/EVALUATION.md), or several as a comma list; or a held-out set: the coloured shapes "
        "(default), the skills suite (per-skill accuracy, 95%% Wilson "
        "intervals, the reference reply's mean probability, and the swapped-image and no-image controls; the "
        "canary's measurement), the detail set (fine "
        "patterns that need AnyRes; accuracy with its 95%% Wilson interval) or the synthetic video clips (motion and "
        "colour over time, at the checkpoint's num_frames)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="held-out questions to ask (200; skills: 1000; detail: 300; video: 200; a benchmark: all, else its first "
        "LIMIT)",
    )
    parser.add_argument("--seed", type=int, default=0, help="synthetic data seed (as model.data.synthetic_seed)")
    parser.add_argument("--data-dir", type=Path, help="a benchmark suite's files (LLaVA's playground/data/eval)")
    parser.add_argument("--output-dir", type=Path, help="a benchmark suite's answers and scores.json")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="16; a benchmark suite: LLaVA's setting")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument(
        "--score",
        type=Path,
        metavar="ANSWERS_FILE",
        help="score this answers file (a benchmark suite's answers.jsonl) with --suite's official rule; no model",
    )
    args = parser.parse_args(argv)
    if args.score is not None:  # score what was answered before: no checkpoint is read
        if args.suite not in BENCHMARKS or args.data_dir is None or args.output_dir is None:
            raise ConfigError("--score needs a benchmark --suite with its --data-dir and an --output-dir")
        if not args.score.is_file():
            raise ConfigError(f"--score {args.score}: no such answers file")
        print(
            json.dumps(
                score_answers(load_benchmark(args.suite, args.data_dir, args.limit), args.score, args.output_dir)
            )
        )
        return
    checkpoint = args.checkpoint or default_checkpoint()
    refuse_nemo_checkpoint(checkpoint, "--checkpoint")
    hf_dir = is_hf_model_dir(checkpoint)
    if not hf_dir and not is_neva_checkpoint(checkpoint) and not is_step_checkpoint(checkpoint):
        raise ConfigError(
            f"--checkpoint: no neva checkpoint or HF model directory at {checkpoint}: run `python -m neva.train "
            "+stage=pretrain` and `python -m neva.train +stage=finetune` first, or pass --checkpoint"
        )
    if (args.input_file is None) != (args.output_file is None):
        raise ConfigError("--input-file and --output-file go together")
    names = [n.strip() for n in args.suite.split(",")] if args.input_file is None else []
    unknown = [n for n in names if n not in SUITES and n not in BENCHMARKS]
    if unknown:
        raise ConfigError(
            f"--suite {unknown[0]!r}: no such benchmark or suite; choose from {', '.join([*BENCHMARKS, *SUITES])}"
        )
    if len(names) > 1 and any(n in SUITES for n in names):
        raise ConfigError(f"--suite {args.suite}: a comma list takes benchmarks only ({', '.join(SUITES)} run alone)")
    benches = [n for n in names if n in BENCHMARKS]
    if benches and (args.data_dir is None or args.output_dir is None):
        raise ConfigError(f"--suite {args.suite} needs --data-dir (the benchmarks' files) and --output-dir")
    loaded = [load_benchmark(n, args.data_dir, args.limit) for n in benches]  # every file checked before the model
    torch.set_grad_enabled(False)
    model, tokenizer, meta = load_answering_model(checkpoint, hf_dir)
    if args.template is not None:
        meta = {**meta, "conv_template": args.template}
    name = Path(checkpoint).name
    new_tokens = 16 if args.max_new_tokens is None else args.max_new_tokens  # a synthetic suite's, a question file's

    def answerer(max_new_tokens: int) -> Answerer:
        return Answerer.for_model(model, tokenizer, meta, GenerationConfig(max_new_tokens=max_new_tokens))

    if args.input_file is not None:
        result = evaluate_file(answerer(new_tokens), args.input_file, args.output_file, args.image_folder, name,
                               args.batch_size)  # fmt: skip
    elif benches:
        results = []
        for bench in loaded:
            tokens = args.max_new_tokens if args.max_new_tokens is not None else BENCHMARKS[bench.name].max_new_tokens
            out = args.output_dir if len(loaded) == 1 else args.output_dir / bench.name
            ask = answerer(tokens)
            results.append(run_benchmark(bench, out, lambda items, n, ask=ask: ask.answer_all(items, n, keep_going=True),
                                         name, args.batch_size, tokens))  # fmt: skip
        if len(results) > 1:
            for r in results:
                r["checkpoint"] = str(Path(checkpoint).resolve())
            (args.output_dir / "scores.json").write_text(json.dumps(results, indent=1) + "\n")
            print("\n".join(table_lines(results)))
            return
        result = results[0]
    else:
        evaluate_suite, default_limit = SUITES[names[0]]
        result = evaluate_suite(answerer(new_tokens), args.limit or default_limit, args.seed, args.batch_size)
    result["checkpoint"] = str(Path(checkpoint).resolve())
    print(json.dumps(result))


def load_answering_model(checkpoint: str, hf_dir: bool) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, metadata)`` in fp32: a neva checkpoint (a step checkpoint merged first), or an HF
    directory imported in memory."""
    if hf_dir:
        return load_hf_model(checkpoint, dtype=torch.float32)
    with as_neva_checkpoint(checkpoint) as directory:
        return load_model(directory, dtype=torch.float32), load_tokenizer(directory), load_metadata(directory)


SHOWN = {
    "fraction": (100, 2, "%"),
    "percent": (1, 2, "%"),
    "points": (1, 1, " points"),
    "points of 1000": (1, 0, "/1000"),
}  # unit → (scale, decimals, suffix) as papers print it


def table_lines(results: list[dict[str, Any]]) -> list[str]:
    """One line per benchmark: its top-level scores as papers print them (a fraction as a percentage, MME's points,
    OCRBench's out of 1000; ``± stderr`` where it has one), questions, skipped; what a line leaves out (categories,
    splits, files) is in the benchmark's ``scores.json``, with each score's unit (``neva.benchmarks.table.UNITS``)."""
    lines = []
    for r in results:
        cells = []
        for key, unit in r.get("units", {}).items():
            value, err = r[key], r.get(f"{key}_stderr")
            scale, decimals, suffix = SHOWN.get(unit, (1, 4, f" ({unit})"))
            cell = f"{key} {scale * value:.{decimals}f}{suffix}"
            cells.append(cell + (f" ± {scale * err:.{decimals}f}" if isinstance(err, (int, float)) else ""))
        cells.append(f"questions {r['questions']} skipped {r['skipped']}")
        lines.append(f"{r['suite']:<20} " + "  ".join(cells))
    return lines


if __name__ == "__main__":
    main()
