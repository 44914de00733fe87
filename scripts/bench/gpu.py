"""GPU mode: Llama-2 7B/13B-shaped NeVA (random weights) trained on one GPU the way ``neva.train`` trains it.

Per case: the stage's config with bf16 O2 (``trainer.precision=bf16 model.megatron_amp_O2=true``) and padded
micro-batches (``model.data.packing=false``, the GPU default: right padding keeps SDPA on its causal flash kernel),
built by training's own path (``bench.build``: meta model with the stage's trainable policy → ``parallelize`` →
``Engine``), fused AdamW, and ``Engine.forward_backward`` over ``--accum`` micro-batches per optimizer step. Samples are
1 image + ~``--text-tokens`` text tokens (±20%), the configuration NVIDIA's published NeVA numbers use (LCS-558K
captions / short instructions). FLOPs and MFU come from ``neva.models.flops``, as in training's metrics.csv.

Micro-batch size: as many of the longest samples as ``--tokens-per-microbatch`` holds, lowered until the planner's
memory model (``neva.planner.plan_run`` on this one-GPU layout, the case's own architecture) puts the busiest
moment within ``--memory-fraction`` of the device's memory; an out-of-memory error anyway retries at half the
micro-batch. MFU is reported against the device's datasheet peak (``neva.models.flops``) and against the bf16 matmul
rate measured at the start of the same run.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from bench.build import build_engine, stage_config, step_flops
from bench.data import PAD_ID, StreamSpec, make_batches, real_tokens
from neva.config import ClusterConfig, TrainConfig
from neva.models.config import NevaConfig
from neva.models.flops import device_peak_tflops
from neva.models.presets import build_config
from neva.parallel.compute_plans import compile_enabled
from neva.planner.plan import GiB, Plan, plan_run

# Targets on one H200 (issues #6 and #13; NVIDIA's published H100 per-GPU figures in brackets). MFU at 336 px is
# against the bf16 matmul rate measured in the same run (≈ 790 TFLOP/s on an H200), not the 989 of the datasheet.
TARGETS = {
    "13b-pretrain-224": ("samples_per_sec", 20.0),  # published 9.9
    "7b-finetune-224": ("samples_per_sec", 15.0),  # published 5.8
    "13b-pretrain-336": ("mfu_vs_measured_matmul", 0.45),
    "7b-finetune-336": ("mfu_vs_measured_matmul", 0.45),
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
        f"model.compile={compile_setting(args)}",
    )


def compile_setting(args: Any) -> str:
    """``model.compile`` as ``--compile`` / ``--no-compile`` set it; neither gives training's default, ``auto``."""
    return "auto" if args.compile is None else str(bool(args.compile)).lower()


def text_spec(case: Case, args: Any, cfg: NevaConfig) -> StreamSpec:
    """The case's sample stream: one image + ``--text-tokens`` (±20%) text tokens per sample."""
    text = 10 if args.gpu_shapes_smoke else args.text_tokens
    return StreamSpec(
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


def device_memory_gib(device: torch.device, args: Any) -> float:
    """Memory of the device (``--memory-gib`` wins; CPU smoke runs pretend 8 GiB)."""
    if args.memory_gib:
        return args.memory_gib
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GiB
    return 8.0


def planned_memory(case: Case, args: Any, cfg: NevaConfig, mbs: int, memory_gib: float, peak: float) -> Plan:
    """The planner's prediction for this case on one GPU at micro-batch ``mbs`` (samples of the longest length)."""
    train_cfg = _composed(case, args)
    model = dataclasses.replace(train_cfg.model, micro_batch_size=mbs, global_batch_size=mbs * args.accum)
    cluster = ClusterConfig(
        name="benchmark", gpus_per_node=1, gpu_name="this device", gpu_memory_gb=memory_gib, peak_tflops_bf16=peak
    )
    one_gpu = dataclasses.replace(
        train_cfg, model=model, cluster=cluster, trainer=dataclasses.replace(train_cfg.trainer, devices=1, num_nodes=1)
    )
    return plan_run(one_gpu, text_tokens=text_spec(case, args, cfg).text_max, model=cfg)


def _composed(case: Case, args: Any) -> TrainConfig:
    """``case_train_config`` at micro-batch 1, composed once per case (Hydra composition is the slow part of a plan)."""
    key = (case, args.accum, args.seed, args.compile)
    if key not in _COMPOSED:
        _COMPOSED[key] = case_train_config(case, args, 1)
    return _COMPOSED[key]


_COMPOSED: dict[tuple, TrainConfig] = {}


def choose_micro_batch(case: Case, args: Any, cfg: NevaConfig, memory_gib: float, peak: float) -> tuple[int, Plan]:
    """The largest micro-batch within the token budget that the planner's memory model fits in ``--memory-fraction``
    of the device (``--micro-batch-size`` fixes it instead); ``(0, plan of 1)`` when not even one sample fits."""
    budget = memory_gib * args.memory_fraction
    if args.micro_batch_size:
        return args.micro_batch_size, planned_memory(case, args, cfg, args.micro_batch_size, memory_gib, peak)
    tokens = args.tokens_per_microbatch or (128 if args.gpu_shapes_smoke else 12288)
    plan = planned_memory(case, args, cfg, 1, memory_gib, peak)
    mbs = max(1, tokens // plan.seq_len)
    while mbs >= 1:
        plan = planned_memory(case, args, cfg, mbs, memory_gib, peak)
        if plan.peak.total <= budget * GiB:
            return mbs, plan
        mbs -= 1
    return 0, plan


def matmul_peak_tflops(device: torch.device, smoke: bool) -> float:
    """bf16 matmul rate of ``device`` measured now: mean of 10 products of random square matrices (8192 on a GPU,
    256 on a CPU smoke run) after 3 warm-ups, the measure the device notes quote (≈ 790 TFLOP/s on an H200)."""
    n = 256 if smoke or device.type != "cuda" else 8192
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    for _ in range(3):
        a @ b
    _sync(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - t) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, args: Any, device: torch.device, mbs: int, peaks: dict[str, float | None]) -> dict[str, Any]:
    """Build, warm up and time one case at micro-batch ``mbs``; throughput, FLOPs and peak memory."""
    from neva.data.collate import Collator
    from neva.training.optim import build_optimizer

    cfg = case_config(case, args.gpu_shapes_smoke)
    train_cfg = case_train_config(case, args, mbs)
    engine, model_flops = build_engine(cfg, train_cfg, device)
    engine.model.train()
    optimizer = build_optimizer(engine.named_trainable_parameters(), train_cfg.model.optim)

    spec = text_spec(case, args, cfg)
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
    padded = statistics.mean(sum(int(b.input_ids.numel()) for b in s) for s in steps[args.warmup :])
    flops = statistics.mean(flops_per_step[args.warmup :])
    tflops = flops / med / 1e12
    table, measured_peak = peaks["table"], peaks["measured"]
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
        "mfu": tflops / table if table else None,
        "mfu_vs_measured_matmul": tflops / measured_peak if measured_peak else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        "loss": float(loss),
        "step_s": times,
    }
    del engine, optimizer, steps, micro
    return result


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _measure(case: Case, args: Any, device: torch.device, peaks: dict[str, float | None]) -> dict[str, Any]:
    """One case at the planned micro-batch; an out-of-memory error retries at half of it (twice at most)."""
    cfg = case_config(case, args.gpu_shapes_smoke)
    memory = device_memory_gib(device, args)
    planner_peak = peaks["table"] or peaks["measured"]
    mbs, plan = choose_micro_batch(case, args, cfg, memory, planner_peak)
    budget = memory * args.memory_fraction
    if mbs == 0:
        return {
            "case": case.name,
            "error": f"planner: one sample needs {plan.peak.total / GiB:.1f} GiB, over {budget:.1f} GiB "
            f"({args.memory_fraction:g} of {memory:.1f} GiB)",
        }
    ooms: list[int] = []
    while True:
        try:
            result = run_case(case, args, device, mbs, peaks)
            break
        except torch.OutOfMemoryError as exc:
            ooms.append(mbs)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if len(ooms) > 2 or mbs == 1:
                return {"case": case.name, "error": f"OOM at micro-batch {ooms}: {str(exc).splitlines()[0]}"}
            mbs //= 2
            plan = planned_memory(case, args, cfg, mbs, memory, planner_peak)
    result["planned_peak_gib"] = plan.peak.total / GiB
    result["planned_activations_gib"] = plan.peak.activations / GiB
    result["memory_budget_gib"] = budget
    result["oom_at_micro_batch"] = ooms
    return result


def plan_cases(cases: list[Case], args: Any, device: torch.device) -> dict[str, Any]:
    """``--plan-only``: the micro-batch each case would run and the planner's memory for it, without building a
    model (``--memory-gib 140.4`` plans an H200 from any machine)."""
    memory = device_memory_gib(device, args)
    peak = peak_tflops(device, args.peak_tflops) or 989.0  # the step time is not reported: any peak will do
    planned = {}
    for case in cases:
        cfg = case_config(case, args.gpu_shapes_smoke)
        mbs, plan = choose_micro_batch(case, args, cfg, memory, peak)
        planned[case.name] = {
            "case": case.name,
            "micro_batch_size": mbs,
            "seq_len": plan.seq_len,
            "tokens_per_microbatch": mbs * plan.seq_len,
            "planned_peak_gib": plan.peak.total / GiB,
            "planned_activations_gib": plan.peak.activations / GiB,
            "memory_budget_gib": memory * args.memory_fraction,
        }
        r = planned[case.name]
        print(
            f"  {case.name}: micro-batch {mbs} x {plan.seq_len} tokens, planned {r['planned_peak_gib']:.1f} GiB "
            f"(activations {r['planned_activations_gib']:.1f}) of {r['memory_budget_gib']:.1f} GiB",
            flush=True,
        )
    return {"mode": "gpu-plan", "memory_gib": memory, "cases": planned}


def run_gpu(args: Any) -> dict[str, Any]:
    """Run every case (an OOM or failure is recorded and the next case runs); print the table; return the summary.

    With ``--json-lines`` each case also prints one JSON line as soon as it ends (a run stopped by a time limit
    keeps the cases it finished)."""
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible (use --device cpu --gpu-shapes-smoke to test the path)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cases = [Case.parse(c) for c in args.cases.split(",") if c.strip()]
    if args.plan_only:
        return plan_cases(cases, args, device)
    # Resolved as training resolves model.compile (the engine below applies the same setting).
    compiled = compile_enabled(_composed(cases[0], args).model.compile, device) if cases else False
    peaks = {
        "table": peak_tflops(device, args.peak_tflops),
        "measured": matmul_peak_tflops(device, args.gpu_shapes_smoke),
    }
    print(
        f"# GPU benchmark on {name}{' (tiny smoke shapes)' if args.gpu_shapes_smoke else ''}: {args.warmup} warm-up + "
        f"{args.steps} steps, accum {args.accum}, compile={compiled}; bf16 peak: table {_fmt(peaks['table'], '.0f')}, "
        f"measured matmul {peaks['measured']:.1f} TFLOP/s; memory {device_memory_gib(device, args):.1f} GiB",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            results[case.name] = _measure(case, args, device, peaks)
        except Exception as exc:  # a failing case must not hide the others' numbers
            results[case.name] = {"case": case.name, "error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = results[case.name]
        r["seconds"] = time.perf_counter() - t0
        target = TARGETS.get(case.name)
        if target and not args.gpu_shapes_smoke and "error" not in r and r.get(target[0]) is not None:
            r["target"] = {"metric": target[0], "min": target[1], "pass": r[target[0]] >= target[1]}
        status = r.get("error") or f"{r['samples_per_sec']:.2f} samples/s at micro-batch {r['micro_batch_size']}"
        print(f"  {case.name}: {status} ({r['seconds']:.0f} s)", flush=True)
        if args.json_lines:
            print(json.dumps({"check": "benchmark", **{k: v for k, v in r.items() if k != "step_s"}}), flush=True)

    print()
    print(
        "| case             | mbs x acc | samples/s/GPU | tokens/s | TFLOP/sample | TFLOP/s |  MFU  | MFU meas. "
        "| peak GiB | plan GiB | target |"
    )
    print(
        "|------------------|-----------|---------------|----------|--------------|---------|-------|-----------"
        "|----------|----------|--------|"
    )
    summary: dict[str, Any] = {
        "mode": "gpu",
        "device": name,
        "smoke": bool(args.gpu_shapes_smoke),
        "compile": compiled,
        "peak_tflops": peaks["table"],
        "matmul_peak_tflops": peaks["measured"],
    }
    for case_name, r in results.items():
        verdict = "-" if "target" not in r else ("PASS" if r["target"]["pass"] else "FAIL")
        if "error" in r:
            print(f"| {case_name:<16} | {r['error'][:120]} |")
        else:
            print(
                f"| {case_name:<16} | {r['micro_batch_size']:>3} x {r['accum']:<3} | {r['samples_per_sec']:13.2f} | "
                f"{r['tokens_per_sec']:8.0f} | {r['tflop_per_sample']:12.3f} | {r['tflops']:7.1f} | "
                f"{_fmt(r['mfu'], '5.1%')} | {_fmt(r['mfu_vs_measured_matmul'], '9.1%')} | "
                f"{_fmt(r['peak_mem_gb'], '8.1f')} | {r['planned_peak_gib']:8.1f} | {verdict:<6} |"
            )
        key = case_name.replace("-", "_")
        for metric in ("samples_per_sec", "tokens_per_sec", "tflops", "mfu", "mfu_vs_measured_matmul", "peak_mem_gb"):
            if metric in r:
                summary[f"{key}_{metric}"] = r[metric]
    summary["cases"] = {k: {kk: vv for kk, vv in v.items() if kk != "step_s"} for k, v in results.items()}
    return summary
