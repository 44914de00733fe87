"""The prepared GPU check behind ``scripts/gpu_check.sh``: the four benchmark cases, Qwen3.5's linear attention
(neva's delta rule against flash-linear-attention's kernel where installed: errors and times,
``bench/linear_attention.py``), then a 50-step ``neva.train`` finetune of a ~1B model on the built-in synthetic
images through the real loader, then one step with and without activation offload and FSDP2's CPU offload
(``benchmark.py --offload``); one JSON line per case on stdout.

Each part runs in its own process under a share of the time budget (``--budget-s``, 480 s by default), so a hang or
an out-of-memory error in one part still leaves the others' lines. ``--tiny`` runs the same steps on the CPU with tiny
shapes (what the test runs). Exit status: 0 when every case produced numbers, 1 otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# A ~1.1B decoder (TinyLlama's shape: width 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632) under CLIP ViT-L/14 224.
ONE_B = [
    "model=llama2_7b",
    "vision=clip_vit_l14_224",
    *(
        f"+model.mm_cfg.llm.arch_overrides.{k}={v}"
        for k, v in dict(hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4).items()
    ),
    "trainer.precision=bf16",
    "model.megatron_amp_O2=true",
    "model.micro_batch_size=16",
    "model.global_batch_size=16",
]
TINY = ["trainer.accelerator=cpu", "model.micro_batch_size=4", "model.global_batch_size=4"]
# What a throughput check does not need: validation, step checkpoints, TensorBoard, the progress bar.
QUIET = [
    "trainer.devices=1",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "exp_manager.create_tensorboard_logger=false",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=100000",
]


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def run(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str, str, float]:
    """``(returncode, stdout, stderr tail, seconds)``; 124 when ``timeout`` ran out."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
    return rc, out, err[-2000:], time.perf_counter() - t0


def benchmark(args: argparse.Namespace, env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """The benchmark's per-case JSON lines (cases it did not reach get an error line)."""
    cases = "13b-pretrain-224,7b-finetune-224,13b-pretrain-336,7b-finetune-336"
    cmd = [sys.executable, "scripts/benchmark.py", "--json-lines", "--cases", cases]
    if args.tiny:
        cmd += ["--device", "cpu", "--gpu-shapes-smoke", "--warmup", "0", "--steps", "1", "--accum", "1"]
    else:
        cmd += ["--device", "cuda"]
    rc, out, err, _ = run(cmd, timeout, env)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith('{"check": "benchmark"')]
    seen = {x["case"] for x in lines}
    for case in cases.split(","):
        if case not in seen:
            lines.append({"check": "benchmark", "case": case, "error": f"no result (benchmark rc {rc}): {err[-600:]}"})
    return lines


def summarize_metrics(path: Path, skip: int) -> dict[str, Any]:
    """Medians of a run's metrics.csv after its first ``skip`` steps (start-up, compilation, loader warm-up)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("step_time")]
    steady = rows[skip:] or rows

    def column(name: str) -> list[float]:
        return [float(r[name]) for r in steady if r.get(name) not in (None, "")]

    wait = column("data_wait_fraction")
    return {
        "steps": len(rows),
        "median_step_s": statistics.median(column("step_time")),
        "samples_per_sec": statistics.median(column("samples_per_sec")),
        "data_wait_fraction": statistics.mean(wait) if wait else None,
        "tflops": statistics.median(column("tflops_per_sec_per_device"))
        if column("tflops_per_sec_per_device")
        else None,
        "final_train_loss": float(rows[-1]["train_loss"]) if rows and rows[-1].get("train_loss") else None,
    }


def train(args: argparse.Namespace, env: dict[str, str], deadline: float) -> dict[str, Any]:
    """``neva.train`` pretrain (1 step, the finetune's starting checkpoint), then finetune for ``--train-steps``."""
    steps = 3 if args.tiny else args.train_steps
    model = TINY if args.tiny else ONE_B
    root = Path(tempfile.mkdtemp(prefix="neva_gpu_check_", dir=args.out))
    env = {**env, "NEVA_OUTPUT_ROOT": str(root)}
    line: dict[str, Any] = {"check": "train", "case": f"finetune-{'tiny' if args.tiny else '1b'}-synthetic"}
    for stage, max_steps in (("pretrain", 1), ("finetune", steps)):
        cmd = [sys.executable, "-m", "neva.train", f"+stage={stage}", *model, *QUIET, f"trainer.max_steps={max_steps}"]
        rc, _, err, seconds = run(cmd, deadline - time.perf_counter(), env)
        line[f"{stage}_seconds"] = seconds
        if rc:
            line["error"] = f"{stage} rc {rc}: {err[-600:]}"
            return line
    metrics = root / "finetune" / "metrics.csv"
    line.update(summarize_metrics(metrics, skip=1 if args.tiny else 5))
    if line["steps"] < steps:
        line["error"] = f"{metrics} has {line['steps']} steps, {steps} were asked"
    if line["data_wait_fraction"] is None:
        line["note"] = "metrics.csv has no data_wait_fraction column: compare median_step_s with the benchmark"
    return line


def linear_attention(args: argparse.Namespace, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``bench/linear_attention.py``'s line (kernel against fallback), or the error that stopped it."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "linear_attention.py"), *(["--tiny"] if args.tiny else [])]
    rc, out, err, _ = run(cmd, timeout, env)
    if rc or not out.strip():
        return {"check": "linear_attention", "error": f"rc {rc}: {err[-600:]}"}
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (tests the check without a GPU)")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole check")
    p.add_argument("--benchmark-s", type=float, default=300.0, help="share of the budget the benchmark may use")
    p.add_argument("--train-steps", type=int, default=50)
    p.add_argument("--out", default=None, help="where the training runs write (default: a temporary directory)")
    args = p.parse_args(argv)
    deadline = time.perf_counter() + args.budget_s
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    import torch

    emit(
        {
            "check": "env",
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "tiny": args.tiny,
        }
    )
    lines = benchmark(args, env, min(args.benchmark_s, deadline - time.perf_counter()))
    lines.append(linear_attention(args, env, min(90.0, deadline - time.perf_counter())))
    for line in lines:
        emit(line)
    result = train(args, env, deadline)
    emit(result)
    offload = offload_sides(args, env, deadline)
    for line in offload:
        emit(line)
    return int(any("error" in x for x in [*lines, result, *offload]))


def offload_sides(args: argparse.Namespace, env: dict[str, str], deadline: float) -> list[dict[str, Any]]:
    """``benchmark.py --offload``: one step with and without activation offload (and FSDP2's CPU offload on two
    GPUs): equal loss and gradient norm, and the device memory each saves."""
    cmd = [sys.executable, "scripts/benchmark.py", "--offload", *(["--tiny"] if args.tiny else [])]
    rc, out, err, _ = run(cmd, deadline - time.perf_counter(), env)
    if rc:
        return [{"check": "offload", "error": f"rc {rc}: {err[-600:]}"}]
    sides = json.loads(out.strip().splitlines()[-1])["sides"]
    return [{"check": "offload", **s} for s in sides]


if __name__ == "__main__":
    sys.exit(main())
