"""The prepared GPU check (scripts/gpu_check.sh) runs end to end on the CPU with tiny shapes, and the GPU benchmark's
micro-batches fit an H200 by the planner's memory model (the sizes it used before did not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
H200_GIB = 143771 * 2**20 / 2**30  # what torch reports for an H200 (143771 MiB)


def _bench():
    """``scripts/benchmark.py`` and its ``bench`` package (scripts/ is not a package: the benchmark puts it on the
    path, as tests/training/test_flops.py does)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark
    from bench import gpu

    return benchmark, gpu


def test_benchmark_micro_batches_fit_an_h200() -> None:
    benchmark, gpu = _bench()
    args = benchmark.parse_args(["--plan-only", "--memory-gib", f"{H200_GIB}"])
    planned = gpu.run_gpu(args)["cases"]
    assert set(planned) == {"13b-pretrain-224", "7b-finetune-224", "13b-pretrain-336", "7b-finetune-336"}
    for case in planned.values():
        assert case["micro_batch_size"] >= 1
        assert case["planned_peak_gib"] <= case["memory_budget_gib"] <= H200_GIB
        assert case["tokens_per_microbatch"] <= 12288
    # The sizes the benchmark used to run (13B pretrain 32, 7B finetune 8) do not fit at 336 px.
    for name, old in (("13b-pretrain-336", 32), ("7b-finetune-336", 8)):
        case = gpu.Case.parse(name)
        plan = gpu.planned_memory(case, args, gpu.case_config(case, False), old, H200_GIB, 989.0)
        assert plan.peak.total / 2**30 > H200_GIB


def test_benchmark_compiles_as_training_does_unless_told() -> None:
    """No flag: ``model.compile=auto``, resolved by training's own rule (on for CUDA, off on the CPU)."""
    import torch

    from neva.parallel.compute_plans import compile_enabled

    benchmark, gpu = _bench()
    case = gpu.Case.parse("7b-finetune-224")
    settings = {}
    for flags in ([], ["--compile"], ["--no-compile"]):
        args = benchmark.parse_args(["--plan-only", *flags])
        settings[tuple(flags)] = gpu.case_train_config(case, args, 1).model.compile
    assert settings == {(): "auto", ("--compile",): True, ("--no-compile",): False}
    assert compile_enabled(settings[()], torch.device("cuda")) and not compile_enabled(
        settings[()], torch.device("cpu")
    )


@pytest.mark.slow
def test_gpu_check_script_runs_tiny_on_cpu(tmp_path) -> None:
    env = {
        **os.environ,
        "NEVA_GPU_CHECK_TINY": "1",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    checks = ["env", "benchmark", "benchmark", "benchmark", "benchmark", "linear_attention", "train",
              "offload", "offload", "offload"]  # fmt: skip
    assert [x["check"] for x in lines] == checks
    assert "error" not in lines[5] and lines[5]["fallback_s"] > 0, lines[5]
    for case in lines[1:5]:
        assert "error" not in case, case
        assert case["samples_per_sec"] > 0 and case["mfu_vs_measured_matmul"] > 0
        assert case["planned_peak_gib"] <= case["memory_budget_gib"]
    train = lines[6]
    assert "error" not in train, train
    assert train["steps"] == 3 and train["median_step_s"] > 0
    assert train["data_wait_fraction"] is None or 0 <= train["data_wait_fraction"] <= 1
    # activation offload and FSDP2's CPU offload on one process: the same step (on the CPU they move nothing)
    plain, *offloaded = lines[7:]
    assert "error" not in plain
    for side in offloaded:
        assert side["loss_rel_diff"] <= 1e-6 and side["grad_norm_rel_diff"] <= 1e-6, side
