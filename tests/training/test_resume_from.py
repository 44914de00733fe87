"""``exp_manager.resume_from_checkpoint=PATH``: a run resumes from a chosen step checkpoint (here another run's
``step=2.ckpt``, not its newest) and continues that run's curve; a path that is not there stops the run naming it."""

import subprocess

import pytest

from tests.training.test_cli import ENV, read_losses, train_cmd, train_forked

pytestmark = pytest.mark.slow

SIX = [
    "trainer.max_steps=6",
    "trainer.log_every_n_steps=1",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
    "exp_manager.checkpoint_callback_params.save_top_k=-1",
]


def train(exp_dir, *overrides):
    return train_forked(exp_dir, *SIX, *overrides, timeout=600)


def test_resume_from_a_chosen_step_checkpoint(tmp_path):
    first = tmp_path / "first"
    done = train(first)
    assert done.returncode == 0, done.stderr[-2000:]
    chosen = first / "checkpoints" / "step=2.ckpt"
    assert chosen.is_file() and (first / "checkpoints" / "step=6.ckpt").is_file()

    # Quoted: Hydra reads an unquoted `=` inside a value as a syntax error.
    again = train(tmp_path / "second", f"exp_manager.resume_from_checkpoint='{chosen}'")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from {chosen} at step 2" in again.stdout + again.stderr
    reference, resumed = read_losses(first), read_losses(tmp_path / "second")
    assert sorted(resumed) == [3, 4, 5, 6]  # steps 1-2 came from the checkpoint
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step

    # Rerun with the same arguments (a requeued job): it has its own checkpoints now and does not start over.
    rerun = train(tmp_path / "second", f"exp_manager.resume_from_checkpoint='{chosen}'")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"resuming from {tmp_path / 'second' / 'checkpoints'}" in rerun.stdout + rerun.stderr
    assert "at step 6" in rerun.stdout + rerun.stderr

    missing = subprocess.run(  # the refusal's exit status: the process's
        train_cmd(tmp_path / "third", *SIX, f"exp_manager.resume_from_checkpoint={tmp_path / 'nothing.ckpt'}"),
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "exp_manager.resume_from_checkpoint=" in missing.stderr and "no such checkpoint" in missing.stderr
    assert not (tmp_path / "third" / "metrics.csv").exists()
