"""GPU mode: Llama-2 7B/13B-shaped NeVA (random weights) trained on one GPU the way ``neva.train`` trains it.

Per case: the stage's config with bf16 O2 (``trainer.precision=bf16 model.megatron_amp_O2=true``) and padded
micro-batches (``model.data.packing=false``, the GPU default: right padding keeps SDPA on its causal flash kernel),
built by training's own path (``bench.build``: meta model with the stage's trainable policy → ``parallelize`` →
``Engine``), fused AdamW, and ``Engine.forward_backward`` over ``--accum`` micro-batches per optimizer step. Samples are
1 image + ~``--text-tokens`` text tokens (±20%), the configuration NVIDIA's published NeVA numbers use (LCS-558K
captions / short instructions). FLOPs and MFU come from ``neva.models.flops``, as in training's metrics.csv.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from bench.build import build_engine, stage_config, step_flops
from bench.data import PAD_ID, StreamSpec, make_batches, real_tokens
from neva.config import TrainConfig
from neva.models.config import NevaConfig
from neva.models.flops import device_peak_tflops
from neva.models.presets import build_config

# Issue #6 targets on one H200 (NVIDIA's published H100 per-GPU figures in brackets).
TARGETS = {
    "13b-pretrain-224": ("samples_per_sec", 20.0),  # published 9.9
    "7b-finetune-224": ("samples_per_sec", 15.0),  # published 5.8
    "13b-pretrain-336": ("mfu", 0.45),
    "7b-finetune-336": ("mfu", 0.45),
}

SMOKE_LLM = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, max_seq_len=512)


@dataclass(frozen=True)
class Case:
    """One measurement: model size, stage, image resolution."""

    size: str  # 7b | 13b
    stage: str  # pretrain | finetune
    px: int  # 224 | 336

    @property
    def name(self) -> str:
        return f"{self.size}-{self.stage}-{self.px}"

    @classmethod
    def parse(cls, text: str) -> Case:
        size, stage, px = text.strip().split("-")
        if size not in ("7b", "13b") or stage not in ("pretrain", "finetune") or px not in ("224", "336"):
            raise ValueError(f"bad case {text!r}: expected <7b|13b>-<pretrain|finetune>-<224|336>")
        return cls(size, stage, int(px))


def case_config(case: Case, smoke: bool) -> NevaConfig:
    """Full Llama-2 + CLIP ViT-L/14 shapes, or tiny ones with the same structure for ``--gpu-shapes-smoke``."""
    if smoke:
        # 28 / 42 px in 7 px patches: 16 / 36 image tokens, the 224 / 336 ratio in miniature.
        vision = dict(
            image_size=case.px // 8, patch_size=7, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4
        )
        return build_config(llm=dict(SMOKE_LLM), vision=vision)
    return build_config(llm=f"llama2_{case.size}", vision=f"clip_vit_l14_{case.px}")


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """bf16 peak of ``device`` for MFU (``--peak-tflops`` wins; None when unknown)."""
    return device_peak_tflops(torch.cuda.get_device_name(device) if device.type == "cuda" else None, override)


def case_train_config(case: Case, args: Any, micro_batch_size: int) -> TrainConfig:
    """The stage's training config as the GPU runs it: bf16 O2, padded micro-batches, ``--accum`` per step."""
    return stage_config(
        case.stage,
        "trainer.precision=bf16",
        "model.megatron_amp_O2=true",
        "model.data.packing=false",
        f"model.micro_batch_size={micro_batch_size}",
        f"model.global_batch_size={micro_batch_size * args.accum}",
        f"model.optim.lr={2e-3 if case.stage == 'pretrain' else 2e-5}",
        f"model.seed={args.seed}",
        f"model.compile={'true' if args.compile else 'false'}",
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, args: Any, device: torch.device) -> dict[str, Any]:
    """Build, warm up and time one case; throughput, FLOPs and peak memory."""
    from neva.data.collate import Collator
    from neva.training.optim import build_optimizer

    smoke = args.gpu_shapes_smoke
    cfg = case_config(case, smoke)
    mbs = (2 if smoke else args.pretrain_mbs) if case.stage == "pretrain" else (2 if smoke else args.finetune_mbs)
    train_cfg = case_train_config(case, args, mbs)
    engine, model_flops = build_engine(cfg, train_cfg, device)
    engine.model.train()
    optimizer = build_optimizer(engine.named_trainable_parameters(), train_cfg.model.optim)

    text = 10 if smoke else args.text_tokens
    spec = StreamSpec(
        vocab_size=cfg.llm.vocab_size,
        image_token_id=cfg.image_token_id,
        num_image_tokens=cfg.num_image_tokens,
        image_size=cfg.vision.image_size,
        text_median=text,
        text_sigma=0.1,
        text_min=int(text * 0.8),
        text_max=int(text * 1.2),
        text_only_fraction=0.0,
        learned_fraction=0.9 if case.stage == "pretrain" else 0.5,
        seed=args.seed,
    )
    n_steps = args.warmup + args.steps
    micro = make_batches(spec, mbs, n_steps * args.accum)
    data = train_cfg.model.data
    collate = Collator(PAD_ID, cfg.llm.max_seq_len, data.pad_to_multiple_of, data.packing)
    steps = [[collate(mb) for mb in micro[i * args.accum : (i + 1) * args.accum]] for i in range(n_steps)]
    samples_per_step = mbs * args.accum
    flops_per_step = [
        step_flops(model_flops, [s for mb in micro[i * args.accum : (i + 1) * args.accum] for s in mb])
        for i in range(n_steps)
    ]

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i, batches in enumerate(steps):
        _sync(device)
        t = time.perf_counter()
        loss, _ = engine.forward_backward(batches)
        engine.clip_grad_norm(train_cfg.trainer.gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.after_optimizer_step()
        _sync(device)
        times.append(time.perf_counter() - t)
        if i == 0 and not torch.isfinite(loss):
            raise RuntimeError(f"{case.name}: non-finite loss {float(loss)}")
    measured = times[args.warmup :]
    med = statistics.median(measured)
    tokens = statistics.mean(
        sum(real_tokens(mb) for mb in micro[i * args.accum : (i + 1) * args.accum]) for i in range(args.warmup, n_steps)
    )
    padded = statistics.mean(sum(int(b["input_ids"].numel()) for b in s) for s in steps[args.warmup :])
    flops = statistics.mean(flops_per_step[args.warmup :])
    peak = peak_tflops(device, args.peak_tflops)
    tflops = flops / med / 1e12
    result = {
        "case": case.name,
        "micro_batch_size": mbs,
        "accum": args.accum,
        "samples_per_step": samples_per_step,
        "median_step_s": med,
        "samples_per_sec": samples_per_step / med,
        "tokens_per_sec": tokens / med,
        "tokens_per_sample": tokens / samples_per_step,
        "padding_fraction": 1 - tokens / padded,
        "tflop_per_sample": flops / samples_per_step / 1e12,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "loss": float(loss),
        "step_s": times,
    }
    del engine, optimizer, steps, micro
    return result


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run_gpu(args: Any) -> dict[str, Any]:
    """Run every case (an OOM or failure is recorded and the next case runs); print the table; return the summary."""
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible (use --device cpu --gpu-shapes-smoke to test the path)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cases = [Case.parse(c) for c in args.cases.split(",") if c.strip()]
    print(
        f"# GPU benchmark on {name}{' (tiny smoke shapes)' if args.gpu_shapes_smoke else ''}: {args.warmup} warm-up + {args.steps} steps, accum {args.accum}, compile={args.compile}",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            results[case.name] = run_case(case, args, device)
        except torch.OutOfMemoryError as exc:
            results[case.name] = {"case": case.name, "error": f"OOM: {str(exc).splitlines()[0]}"}
        except Exception as exc:  # a failing case must not hide the others' numbers
            results[case.name] = {"case": case.name, "error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = results[case.name]
        status = r.get("error") or f"{r['samples_per_sec']:.2f} samples/s"
        print(f"  {case.name}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)

    print()
    print(
        "| case             | mbs x acc | samples/s/GPU | tokens/s | TFLOP/sample | TFLOP/s |  MFU  | peak GiB | target |"
    )
    print(
        "|------------------|-----------|---------------|----------|--------------|---------|-------|----------|--------|"
    )
    summary: dict[str, Any] = {
        "mode": "gpu",
        "device": name,
        "smoke": bool(args.gpu_shapes_smoke),
        "compile": bool(args.compile),
    }
    summary["peak_tflops"] = peak_tflops(device, args.peak_tflops)
    for case_name, r in results.items():
        target = TARGETS.get(case_name)
        verdict = "-"
        if target and not args.gpu_shapes_smoke and "error" not in r and r.get(target[0]) is not None:
            verdict = f"{'PASS' if r[target[0]] >= target[1] else 'FAIL'}"
            r["target"] = {"metric": target[0], "min": target[1], "pass": r[target[0]] >= target[1]}
        if "error" in r:
            print(f"| {case_name:<16} | {r['error'][:80]} |")
        else:
            print(
                f"| {case_name:<16} | {r['micro_batch_size']:>3} x {r['accum']:<3} | {r['samples_per_sec']:13.2f} | "
                f"{r['tokens_per_sec']:8.0f} | {r['tflop_per_sample']:12.3f} | {r['tflops']:7.1f} | "
                f"{_fmt(r['mfu'], '5.1%')} | {_fmt(r['peak_mem_gb'], '8.1f')} | {verdict:<6} |"
            )
        key = case_name.replace("-", "_")
        for metric in ("samples_per_sec", "tokens_per_sec", "tflops", "mfu", "peak_mem_gb"):
            if metric in r:
                summary[f"{key}_{metric}"] = r[metric]
    summary["cases"] = {k: {kk: vv for kk, vv in v.items() if kk != "step_s"} for k, v in results.items()}
    return summary
