"""The video input-pipeline benchmark (``scripts/benchmark.py --video-pipeline``) runs end to end on one short clip:
both sides give the same frames and the summary carries the workers a node needs. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_video_benchmark_runs_and_both_sides_give_the_same_frames() -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--video-pipeline", "--videos", "1"]
    cmd += ["--video-seconds", "1", "--repeats", "1", "--video-size", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["mode"] == "video_pipeline" and summary["same_pixels"]
    assert all(rate > 0 for rate in summary["frames_per_s_per_worker"].values())
    assert summary["workers_per_node"] == 8 * summary["workers_per_gpu"] >= 8
