"""``python -m neva.train -m`` (Hydra multirun): each job of a two-value sweep trains its own run in its own
``exp_dir`` under one sweep directory inside the output root, none resuming another's checkpoint."""

import csv
import subprocess

import pytest

from tests.parallel.harness import run_module
from tests.training.conftest import LEAN
from tests.training.test_cli import ENV, read_losses, train_cmd

pytestmark = pytest.mark.slow


def test_two_value_sweep_gives_two_independent_runs(tmp_path):
    steps = ["trainer.max_steps=2", "trainer.log_every_n_steps=1"]
    argv = ["-m", "+stage=pretrain", *LEAN, *steps, "model.optim.lr=1e-3,4e-3"]
    env = {**ENV, "NEVA_OUTPUT_ROOT": str(tmp_path / "out")}
    done = run_module("neva.train", argv, env=env, cwd=tmp_path)  # forked from the session's server
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "multirun").exists()  # not Hydra's default ./multirun
    base = tmp_path / "out" / "pretrain"
    runs = [base / "sweep" / "model.optim.lr-0.001", base / "sweep" / "model.optim.lr-0.004"]
    assert sorted(p.name for p in (base / "sweep").iterdir()) == ["hydra", *(r.name for r in runs), "multirun.yaml"]
    lrs = []
    for run in runs:
        assert sorted(read_losses(run)) == [1, 2], run  # two steps each: job 2 did not resume job 1's checkpoint
        assert (run / "final").is_dir() and (run / "checkpoints").is_dir()
        with open(run / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        lrs.append(float(rows[0]["lr"]))
    assert "resuming from" not in done.stdout + done.stderr
    assert lrs[1] == pytest.approx(4 * lrs[0])  # each job trained with its own value
    assert not (base / "checkpoints").exists()  # nothing in the unswept exp_dir
    finals = [line for line in done.stdout.splitlines() if line.endswith("/final")]
    assert finals == [str((run / "final").resolve()) for run in runs]

    # What the sweep used to do: rerun a finished run with another learning rate. It would train nothing and rewrite
    # its final checkpoint; it stops instead, naming the change.
    rerun = subprocess.run(
        train_cmd(runs[0], *steps, "model.optim.lr=4e-3"), env=env, capture_output=True, text=True, timeout=600
    )
    assert rerun.returncode == 2, rerun.stderr[-3000:]
    assert "belongs to a finished run (checkpoint at step 2, trainer.max_steps=2" in rerun.stderr
    assert "model.optim.lr: 0.001 → 0.004" in rerun.stderr
