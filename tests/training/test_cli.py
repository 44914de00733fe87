"""The main job as users run it: ``python -m neva.train`` in subprocesses (config errors, resume after kill -9)."""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training.conftest import LEAN

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}


def train_cmd(exp_dir: Path, *overrides: str, stage: str = "pretrain") -> list[str]:
    return [sys.executable, "-m", "neva.train", f"+stage={stage}", *LEAN, f"exp_manager.exp_dir={exp_dir}", *overrides]


def read_losses(exp_dir: Path) -> dict[int, float]:
    with open(exp_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


def test_no_stage_names_both_stages():
    out = subprocess.run([sys.executable, "-m", "neva.train"], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2
    assert "+stage=pretrain" in out.stderr and "+stage=finetune" in out.stderr


def test_misspelled_override_fails_at_start(tmp_path):
    out = subprocess.run(
        train_cmd(tmp_path, "model.optim.lrr=0.1"), capture_output=True, text=True, env=ENV, timeout=120
    )
    assert out.returncode != 0
    assert "lrr" in out.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_bad_value_and_non_integer_accumulation_fail_at_start(tmp_path):
    out = subprocess.run(
        train_cmd(tmp_path, "model.data.conv_template=vicuna_v2"), capture_output=True, text=True, env=ENV, timeout=120
    )
    assert out.returncode == 2 and "vicuna_v2" in out.stderr
    out = subprocess.run(
        train_cmd(tmp_path, "model.micro_batch_size=3"), capture_output=True, text=True, env=ENV, timeout=120
    )
    assert out.returncode == 2 and "not a multiple" in out.stderr


def test_finetune_without_pretrain_says_what_to_do(tmp_path):
    env = {**ENV, "NEVA_OUTPUT_ROOT": str(tmp_path / "none")}
    out = subprocess.run(
        train_cmd(tmp_path / "ft", stage="finetune"), capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2
    assert "+stage=pretrain" in out.stderr and "model.restore_from_path" in out.stderr


@pytest.mark.slow
def test_resume_after_kill_continues_the_same_loss_curve(tmp_path):
    common = [
        "trainer.max_steps=10",
        "trainer.log_every_n_steps=1",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=3",
    ]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    done = subprocess.run(train_cmd(ref_dir, *common), capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = read_losses(ref_dir)
    assert sorted(reference) == list(range(1, 11))
    assert done.stdout.strip().splitlines()[-1] == str((ref_dir / "final").resolve())

    proc = subprocess.Popen(
        train_cmd(run_dir, *common),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        if (run_dir / "metrics.csv").exists() and max(read_losses(run_dir), default=0) >= 5:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = read_losses(run_dir)
    assert 5 <= max(partial) < 10, "the run must be killed mid-way"
    assert (run_dir / "checkpoints" / "last.ckpt").exists()

    again = subprocess.run(train_cmd(run_dir, *common), capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    resumed = read_losses(run_dir)
    assert sorted(resumed) == sorted(reference)
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), step


@pytest.mark.slow
def test_mid_epoch_resume_is_silent_and_continues_the_curve(tmp_path):
    """A checkpoint inside an epoch (3 steps per epoch here; step 7 is the first of the third) resumes at the next
    sample: the resumed steps equal the uninterrupted run's, and neither of Lightning's resume warnings (a
    non-resumable loader, a non-empty checkpoint directory) is printed, since both would be false."""
    common = [
        "trainer.max_steps=9",
        "trainer.log_every_n_steps=1",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=7",
    ]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "resumed"
    done = subprocess.run(train_cmd(ref_dir, *common), capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = read_losses(ref_dir)
    assert sorted(reference) == list(range(1, 10))

    # The state a run killed after step 7 leaves: its checkpoints, and metrics rows up to step 7.
    shutil.copytree(ref_dir / "checkpoints", run_dir / "checkpoints")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step=7.ckpt"]
    again = subprocess.run(train_cmd(run_dir, *common), capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from" in again.stderr + again.stdout
    for text in ("not resumable", "exists and is not empty"):
        assert text not in again.stderr + again.stdout, again.stderr[-3000:]
    resumed = read_losses(run_dir)
    assert sorted(resumed) == [8, 9]
    for step in (8, 9):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step
