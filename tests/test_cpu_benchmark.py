"""The CPU benchmark (``scripts/benchmark.py --device cpu``) runs end to end with tiny shapes: both sides train in
their own processes, on the same samples with the same semantics (equal first-step losses), and the summary carries
the speedup. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
# AnyRes: against HF LlavaNext; video (videos + AnyRes images + text-only samples): against HF LlavaNextVideo;
# qwen2_5_vl (native-resolution images of random sizes, M-RoPE): against HF Qwen2_5_VLForConditionalGeneration;
# glm4v (the same images through GLM-4.1V's tower and merger, its decoder): against HF Glm4vForConditionalGeneration;
# llama4 (Llama 4's decoder behind the fixed tower): against HF's Llama 4 text model inside LlavaForConditionalGeneration
@pytest.mark.parametrize(
    "mode",
    [[], ["--anyres"], ["--video"], ["--family", "qwen2_5_vl"], ["--family", "glm4v"], ["--family", "llama4"]],
    ids=["fixed", "anyres", "video", "qwen2_5_vl", "glm4v", "llama4"],
)
def test_cpu_benchmark_runs_tiny_and_both_sides_agree(mode) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--device", "cpu", "--smoke", *mode]
    cmd += ["--steps", "1", "--warmup", "1", "--threads", "1", "--no-compare-padding"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["mode"] == "cpu" and summary["smoke"] and summary["neva_packing"]
    # video lays its images out as AnyRes tiles (LlavaNextVideo's layout)
    assert summary["anyres"] == (mode in (["--anyres"], ["--video"])) and summary["video"] == (mode == ["--video"])
    assert summary["neva_samples_per_sec"] > 0 and summary["hf_samples_per_sec"] > 0
    assert summary["neva_first_loss"] == pytest.approx(summary["hf_first_loss"], rel=1e-5)
    assert summary["first_loss_rel_diff"] < 1e-5
    assert summary["speedup_vs_hf"] > 0 and summary["speedup_cpu_time"] > 0
    assert summary["speedup_per_step_median"] > 0 and summary["speedup_cpu_per_step_median"] > 0
    # Packing computed fewer positions than HF's padding, on the same real tokens.
    assert summary["real_tokens_per_step"] <= summary["neva_tokens_per_step"] < summary["hf_tokens_per_step"]
