"""The quality canary in CI: the seeded canary pretrain + finetune, then the skills suite; every number (accuracy and
reply probability, overall and per skill) must land in the band measured for it (tests/training/canary_bands.json,
docs/PERFORMANCE.md). A change that makes training
better or worse moves a skill out and fails here: update the bands only with a measurement that says why."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neva.evaluate import outside_bands

BANDS = Path(__file__).with_name("canary_bands.json")
# One thread: the canary's numbers are bitwise the same on any machine and under any load (the bands were measured so).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}


def run(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_canary_lands_in_its_bands(tmp_path):
    env = {**ENV, "NEVA_OUTPUT_ROOT": str(tmp_path)}
    quiet = "trainer.enable_progress_bar=false"
    run("-m", "neva.train", "+canary=pretrain", quiet, env=env)
    run("-m", "neva.train", "+canary=finetune", quiet, env=env)
    checkpoint = tmp_path / "canary" / "finetune" / "final"
    result = json.loads(run("-m", "neva.evaluate", "--suite", "skills", "--checkpoint", str(checkpoint), env=env))
    bands = json.loads(BANDS.read_text())
    outside = outside_bands(result, bands)
    assert not outside, f"canary out of band (value, band): {outside}; whole result: {json.dumps(result)}"
    assert result["n"] == bands["n"]
