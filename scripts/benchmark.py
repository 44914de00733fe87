#!/usr/bin/env python
"""Training throughput and memory of neva.

CPU mode (``--device cpu``): a mid-size NeVA (4-layer ViT, 8-layer Llama, vocab 32000) trained by neva's step
(its batching, packing, precision, optimizer) against HF ``LlavaForConditionalGeneration`` trained with a plain
AdamW loop on padded batches; same sample stream, same weights, same training semantics (``--anyres``: against
``LlavaNextForConditionalGeneration``; ``--video``: videos mixed in, against
``LlavaNextVideoForConditionalGeneration``). Each side runs in its own child process, so peak memory is per side.

GPU mode (``--device cuda``): Llama-2 7B/13B-shaped NeVA with random weights on one GPU, bf16 O2: pretrain and
finetune samples/s, tokens/s, TFLOP/s and MFU (against the datasheet peak and a bf16 matmul peak measured in the run)
at 224 px (256 image tokens) and 336 px (576); micro-batches from a token budget that the planner's memory model
fits in the device. ``--gpu-shapes-smoke`` runs the same code path with tiny shapes (on CPU too), to test it without
a GPU.

Input-pipeline mode (``--input-pipeline``): decoded-and-preprocessed images/s of one loader worker, neva against
HF ``CLIPImageProcessor`` on the same locally generated JPEGs, and the workers a DGX node needs to feed 8 GPUs.

Video input-pipeline mode (``--video-pipeline``): sampled frames/s of one loader worker, neva's seeking decode against
PyAV's plain decode-all loop on the same locally generated mp4 files, and the workers a DGX node needs.

Data-plan mode (``--data-plan``): seconds and peak MB to plan one epoch's order over samples x sources, neva's order
rule 2 against rule 1 (the implementation before it) in the same run.

Context-parallel mode (``--context-parallel``): one long packed row through a decoder in one process and under CP2
(two gloo processes), and CP2 with its key/value all-gather replaced by a local tensor: the gathers' share of the
step and each process's peak memory (``bench/context_parallel.py``).

Token-budget mode (``--token-budget``): padding share and peak memory of fixed micro-batches against micro-batches
filled to a token budget, the same global batches (``bench/token_budget.py``).

GRPO mode (``--grpo``): one online RL step (rollouts and the update) of neva's GRPO stage against TRL's
``GRPOTrainer`` (from its side environment, ``--trl-site``) on the tiny default model and the built-in verifiable
prompts, the sides alternated step by step (``bench/grpo.py``).

Offload mode (``--offload``): one step with and without activation offload and (two GPUs) FSDP2's CPU offload: loss,
gradient norm and peak device memory of each (``bench/offload.py``; ``--tiny``: the tiny model on the CPU).

Every mode prints a table and, as its last stdout line, one JSON object (see docs/PERFORMANCE.md).

Examples::

    python scripts/benchmark.py --device cpu
    python scripts/benchmark.py --device cuda                 # all GPU cases, ~4 minutes on one H200
    python scripts/benchmark.py --device cpu --smoke           # CPU mode's code path with tiny shapes (CI)
    python scripts/benchmark.py --device cpu --video           # videos + AnyRes images + text vs HF LlavaNextVideo
    python scripts/benchmark.py --device cpu --gpu-shapes-smoke
    python scripts/benchmark.py --input-pipeline              # ~30 s of CPU
    python scripts/benchmark.py --video-pipeline              # a few minutes of CPU (writing the clips)
    python scripts/benchmark.py --data-plan --data-plan-cases 1e6x3,4e6x10,1e8x100,1e9x100
    python scripts/benchmark.py --context-parallel            # ~2 minutes of CPU
    python scripts/benchmark.py --token-budget                # fixed micro-batches vs a token budget, ~3 minutes
    python scripts/benchmark.py --grpo --threads 1        # GRPO step vs TRL's GRPOTrainer, ~1 minute of CPU
    python scripts/benchmark.py --offload                     # activation / FSDP2 offload: equal step, peak memory
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# scripts/ is not a package: make `bench` (next to this file) and the repository's `neva` importable.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))


# CPU mode's row capacity under --smoke (its samples are at most 1 + 16 image + 64 text tokens long).
SMOKE_SEQ_LENGTH = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of both modes."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: neva vs HF; cuda: 7B/13B on one GPU")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default: cpu 3, cuda 4)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default: cpu 1, cuda 2)")
    p.add_argument("--seed", type=int, default=0)
    # CPU mode
    p.add_argument("--stage", default="finetune", choices=["pretrain", "finetune"], help="CPU mode training stage")
    p.add_argument(
        "--batch-size", type=int, default=16, help="CPU mode: samples per optimizer step, both sides (LLaVA-1.5's 16)"
    )
    p.add_argument(
        "--seq-length", type=int, default=None, help="CPU mode: neva's packed row capacity (tokens; default 1024)"
    )
    p.add_argument("--lr", type=float, default=2e-5, help="CPU mode: AdamW learning rate (both sides)")
    p.add_argument("--threads", type=int, default=0, help="CPU mode: torch threads (0 = torch's default)")
    p.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU mode: neva packs samples (model.data.packing=true); --no-packing pads like HF",
    )
    p.add_argument(
        "--compare-padding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU mode: also run neva with the other batching, on the same stream (packed and padded side by side)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU mode with the tiny model and short samples (rows of 128): the code path in seconds, for CI",
    )
    p.add_argument(
        "--family",
        default="llama",
        help="CPU mode: the model family of both sides (bench/cpu.py FAMILIES: qwen2 = q/k/v biases, tied embeddings)",
    )
    p.add_argument(
        "--anyres",
        action="store_true",
        help="CPU mode: LLaVA-NeXT AnyRes (1x1..2x2 tiles, each image a random size) against HF "
        "LlavaNextForConditionalGeneration",
    )
    p.add_argument(
        "--video",
        action="store_true",
        help="CPU mode: LLaVA-NeXT-Video (videos of --num-frames frames, 2x2-pooled, mixed with AnyRes images and "
        "text-only samples) against HF LlavaNextVideoForConditionalGeneration",
    )
    p.add_argument("--child", choices=["neva", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--lockstep", action="store_true", help=argparse.SUPPRESS)
    # GPU mode
    p.add_argument(
        "--cases",
        default="13b-pretrain-224,7b-finetune-224,13b-pretrain-336,7b-finetune-336",
        help="GPU mode: comma-separated <7b|13b>-<pretrain|finetune>-<224|336>",
    )
    p.add_argument(
        "--tokens-per-microbatch",
        type=int,
        default=0,
        help="GPU mode: token budget of a micro-batch (0 = 12288, NVIDIA's 13B pretrain 32 x 384); lowered until the "
        "planner's memory model fits it",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="GPU mode: share of the device memory the planned peak may use (the activation estimate's ~10%% margin)",
    )
    p.add_argument("--memory-gib", type=float, default=0.0, help="GPU mode: device memory (0 = what the GPU reports)")
    p.add_argument(
        "--micro-batch-size", type=int, default=0, help="GPU mode: fix the micro-batch (0 = from the budget)"
    )
    p.add_argument("--json-lines", action="store_true", help="GPU mode: one JSON line per case as it finishes")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="GPU mode: print each case's micro-batch and planned memory, run nothing",
    )
    p.add_argument("--accum", type=int, default=2, help="GPU mode: micro-batches per optimizer step")
    p.add_argument("--text-tokens", type=int, default=100, help="GPU mode: mean text tokens per sample (±20%%)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GPU mode: torch.compile every transformer block (default: model.compile=auto, as training: on CUDA only)",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU mode: bf16 peak for MFU (default by GPU name)")
    p.add_argument("--gpu-shapes-smoke", action="store_true", help="GPU mode code path with tiny shapes (CPU works)")
    # Input-pipeline mode
    p.add_argument("--input-pipeline", action="store_true", help="images/s per loader worker, neva vs HF")
    p.add_argument("--images", type=int, default=48, help="input-pipeline mode: JPEG files per pass")
    p.add_argument("--repeats", type=int, default=5, help="input-pipeline mode: measured passes (median)")
    # Video input-pipeline mode
    p.add_argument(
        "--video-pipeline", action="store_true", help="sampled frames/s per loader worker, neva vs PyAV loop"
    )
    p.add_argument("--videos", type=int, default=4, help="video mode: mp4 files per pass")
    p.add_argument("--video-seconds", type=float, default=30.0, help="video mode: length of each file (30 fps)")
    p.add_argument("--num-frames", type=int, default=8, help="video modes (and CPU --video): frames per video")
    p.add_argument("--video-size", type=int, default=336, help="video mode: the tower's input size frames are fit to")
    p.add_argument(
        "--video-samples-per-gpu", type=float, default=4.0, help="video mode: samples/s per GPU the workers must feed"
    )
    # Data-plan mode
    p.add_argument("--data-plan", action="store_true", help="seconds / peak MB of one epoch's order, rule 2 vs rule 1")
    p.add_argument(
        "--data-plan-cases", default="1e6x3,4e6x10,1e8x100", help="data-plan mode: comma-separated <samples>x<sources>"
    )
    p.add_argument(
        "--data-plan-reference-limit",
        type=float,
        default=5e7,
        help="data-plan mode: largest samples x sources rule 1 runs (it costs ~1 us each)",
    )
    p.add_argument(
        "--data-plan-files",
        type=float,
        default=5e8,
        help="data-plan mode: from this many samples on, rule 2 writes its plan to files and memory-maps them",
    )
    p.add_argument("--data-plan-child", help=argparse.SUPPRESS)
    p.add_argument(
        "--context-parallel", action="store_true", help="CP2's key/value all-gather: its share of the step, memory"
    )
    p.add_argument("--cp-seq", type=int, default=4096, help="context-parallel mode: tokens of the packed row")
    p.add_argument("--cp-docs", type=int, default=4, help="context-parallel mode: documents in the row")
    p.add_argument("--cp-layers", type=int, default=4, help="context-parallel mode: decoder layers")
    p.add_argument("--cp-kv-heads", type=int, default=8, help="context-parallel mode: key/value heads (of 8)")
    p.add_argument(
        "--token-budget", action="store_true", help="padding and peak memory: fixed micro-batches vs a token budget"
    )
    p.add_argument("--token-budget-child", help=argparse.SUPPRESS)
    p.add_argument("--tb-samples", type=int, default=96, help="token-budget mode: records of the generated set")
    p.add_argument("--tb-seq", type=int, default=1536, help="token-budget mode: sequence length")
    p.add_argument("--tb-micro", type=int, default=8, help="token-budget mode: the fixed side's micro-batch size")
    p.add_argument("--tb-accum", type=int, default=2, help="token-budget mode: the fixed side's accumulation")
    p.add_argument("--tb-budget", type=int, default=3072, help="token-budget mode: max_tokens_per_micro_batch")
    p.add_argument("--offload", action="store_true", help="one step with and without activation / FSDP2 offload")
    p.add_argument("--offload-child", help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help="offload mode: the tiny model on the CPU")
    p.add_argument("--offload-seq", type=int, default=8192, help="offload mode: tokens of the packed row (GPU)")
    p.add_argument("--offload-timeout", type=float, default=300.0, help="offload mode: seconds per side")
    p.add_argument("--grpo", action="store_true", help="a GRPO step (rollouts + update) on CPU, neva vs TRL")
    p.add_argument("--grpo-child", choices=["neva", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--grpo-dir", help=argparse.SUPPRESS)
    p.add_argument("--grpo-prompts", type=int, default=4, help="GRPO mode: prompts per step")
    p.add_argument("--grpo-generations", type=int, default=4, help="GRPO mode: completions per prompt")
    p.add_argument("--grpo-max-new", type=int, default=16, help="GRPO mode: most new tokens per completion")
    p.add_argument("--trl-site", default=None, help="GRPO mode: TRL's side environment (default: the TRL test's)")
    args = p.parse_args(argv)
    gpu_path = args.device == "cuda" or args.gpu_shapes_smoke or args.plan_only
    if args.steps is None:
        args.steps = 4 if gpu_path else 3
    if args.warmup is None:
        args.warmup = 2 if gpu_path else 1
    if args.seq_length is None:
        args.seq_length = SMOKE_SEQ_LENGTH if args.smoke else 1024
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the chosen mode; the last stdout line is the JSON summary."""
    args = parse_args(argv)
    if args.data_plan_child:
        from bench.data_plan import child

        impl, samples, count, plan_dir = args.data_plan_child.split(":")
        print(json.dumps(child(impl, int(samples), int(count), plan_dir or None)))
        return
    if args.child:
        from bench.cpu import run_side

        print(json.dumps(run_side(args.child, args)))
        return
    if args.grpo_child:
        from bench.grpo import run_side as grpo_side

        grpo_side(args.grpo_child, args)
        return
    if args.offload_child:
        from bench.offload import run_side as offload_side

        result = offload_side(args.offload_child, args)
        if result is not None:
            print(json.dumps(result))
        return
    if args.offload:
        from bench.offload import run_offload

        print(json.dumps(run_offload(args, os.path.abspath(__file__))))
        return
    if args.token_budget_child:
        from pathlib import Path

        from bench.token_budget import run_side as token_budget_side

        side, data = args.token_budget_child.split(":", 1)
        print(json.dumps(token_budget_side(side, args, Path(data))))
        return
    if args.token_budget:
        from bench.token_budget import run_token_budget

        summary = run_token_budget(args, os.path.abspath(__file__))
    elif args.grpo:
        from bench.grpo import run_grpo

        summary = run_grpo(args)
    elif args.context_parallel:
        from bench.context_parallel import run_context_parallel

        summary = run_context_parallel(args)
    elif args.data_plan:
        from bench.data_plan import run_data_plan

        summary = run_data_plan(args, os.path.abspath(__file__))
    elif args.input_pipeline:
        from bench.input_pipeline import run_input_pipeline

        summary = run_input_pipeline(args)
    elif args.video_pipeline:
        from bench.video_pipeline import run_video_pipeline

        summary = run_video_pipeline(args)
    elif args.device == "cuda" or args.gpu_shapes_smoke or args.plan_only:
        from bench.gpu import run_gpu

        summary = run_gpu(args)
    else:
        from bench.cpu import run_cpu

        summary = run_cpu(args)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
