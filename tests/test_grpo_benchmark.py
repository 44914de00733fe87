"""The GRPO benchmark (``scripts/benchmark.py --grpo``) runs end to end with tiny settings: neva's stage and TRL's
``GRPOTrainer`` (from its side environment) each roll out and update in their own process, and the summary carries
both sides' times and the ratio; without TRL it refuses in one line. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pip_site import cached_site
from tests.training.test_grpo_trl import TRL_PINS

ROOT = Path(__file__).resolve().parents[1]
CMD = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--grpo", "--threads", "1"]


def test_grpo_benchmark_without_trl_refuses_in_one_line(tmp_path) -> None:
    proc = subprocess.run([*CMD, "--trl-site", str(tmp_path / "none")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--trl-site" in proc.stderr


@pytest.mark.slow
def test_grpo_benchmark_runs_both_sides() -> None:
    site = cached_site("trl-1.16.0", TRL_PINS)
    cmd = [*CMD, "--trl-site", str(site), "--steps", "1", "--warmup", "1", "--grpo-prompts", "2",
           "--grpo-generations", "2", "--grpo-max-new", "4"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["mode"] == "grpo" and summary["prompts"] == 2 and summary["generations"] == 2
    for side in ("neva", "trl"):
        r = summary[side]
        assert len(r["steps"]) == 2 and 0 < r["completion_length"] <= 4
        assert 0 < r["median_rollout_s"] < r["median_t_s"] and r["median_update_s"] > 0
    assert summary["step_speedup"] > 0 and summary["step_cpu_speedup"] > 0
