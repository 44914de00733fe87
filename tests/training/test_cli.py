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

from neva.config import compose_config
from neva.data.datamodule import resolve_num_workers
from tests.parallel.harness import run_module
from tests.training.conftest import LEAN

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}


def train_cmd(exp_dir: Path, *overrides: str, stage: str = "pretrain") -> list[str]:
    return [sys.executable, "-m", "neva.train", f"+stage={stage}", *LEAN, f"exp_manager.exp_dir={exp_dir}", *overrides]


def train_forked(
    exp_dir: Path, *overrides: str, stage: str = "pretrain", env: dict[str, str] = ENV, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``train_cmd``'s command as ``subprocess.run(..., capture_output=True, text=True)`` returns it, run in a process
    forked from the session's server (``tests.parallel.harness.run_module``: no interpreter start-up), for runs whose
    test is not about the process (exit statuses of refused inputs, signals and kills keep ``subprocess``)."""
    return run_module("neva.train", train_cmd(exp_dir, *overrides, stage=stage)[3:], env=env, timeout=timeout)


def read_losses(exp_dir: Path) -> dict[int, float]:
    with open(exp_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


def test_no_stage_names_both_stages(tmp_path):
    """One line, exit 2, and nothing written (Hydra's run directory would be ``outputs/None/hydra``)."""
    out = subprocess.run(
        [sys.executable, "-m", "neva.train", "trainer.max_steps=1"],
        capture_output=True, text=True, env=ENV, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2
    assert "+stage=pretrain" in out.stderr and "+stage=finetune" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_presets_and_canaries_select_their_stage():
    """``+preset=...`` / ``+canary=...`` alone name a stage (their defaults choose it): not refused before Hydra."""
    from neva.train import _names_a_stage

    assert _names_a_stage(["+preset=llava15_llama2_7b_pretrain"]) and _names_a_stage(["+canary=finetune"])
    assert _names_a_stage(["+stage=dpo"]) and not _names_a_stage(["model=tiny_qwen2_5_vl", "vision=tiny_qwen2_5_vl"])


def test_llava_data_starts_no_loader_workers_on_cpu(tmp_path):
    """data=llava leaves num_workers to ``auto`` (DATA.md: no worker on CPU, where the model computes)."""
    (tmp_path / "d.json").write_text("[]")
    paths = [f"model.data.data_path={tmp_path / 'd.json'}", f"model.data.image_folder={tmp_path}"]
    cfg = compose_config(["+stage=pretrain", "data=llava", *paths])
    assert cfg.model.data.num_workers == "auto"
    assert resolve_num_workers(cfg.model.data.num_workers, "cpu") == 0


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
    done = train_forked(ref_dir, *common)  # the uninterrupted run and the resume: forked; the killed one: a process
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

    again = train_forked(run_dir, *common)
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

    # The run's first screen is neva's: no logging-service advertisement, no deprecation of Lightning's internals.
    for text in ("litlogger", "LeafSpec"):
        assert text not in done.stderr + done.stdout, done.stderr[-3000:]
    # The last step has its checkpoint too (9 is no multiple of 7).
    ref_ckpts = sorted(p.name for p in (ref_dir / "checkpoints").glob("*.ckpt"))
    assert ref_ckpts == ["last.ckpt", "step=7.ckpt", "step=9.ckpt"]

    # The state a run killed after step 7 leaves: its step-7 checkpoint, and metrics rows up to step 7.
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in ("step=7.ckpt", "step=7.ckpt.manifest.json"):
        shutil.copy2(ref_dir / "checkpoints" / name, run_dir / "checkpoints" / name)
    # forked (the warnings looked for here are the run's, not its imports'; the first screen above is a process's)
    again = train_forked(run_dir, *common)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from" in again.stderr + again.stdout
    for text in ("not resumable", "exists and is not empty"):
        assert text not in again.stderr + again.stdout, again.stderr[-3000:]
    resumed = read_losses(run_dir)
    assert sorted(resumed) == [8, 9]
    for step in (8, 9):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step
