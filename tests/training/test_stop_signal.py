"""SIGTERM / SIGINT / SIGUSR1 to a running ``python -m neva.train`` (one process, and every rank under torchrun): the run stops at
a step boundary with a checkpoint, exits 128 + the signal, writes no ``final``, and a rerun continues the curve."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning_fabric.utilities.load import _METADATA_FILENAME

from tests.training.test_cli import ENV, read_losses, train_cmd, train_forked

pytestmark = pytest.mark.slow

# A learning rate that does not depend on max_steps, so a run stopped on the way to 1000 steps and its rerun to 12
# train exactly like one run of 12.
FLAT_LR = ["model.optim.lr=1e-3", "model.optim.sched.min_lr=1e-3", "model.optim.sched.warmup_steps=0"]
COMMON = [*FLAT_LR, "trainer.log_every_n_steps=1", "exp_manager.checkpoint_callback_params.every_n_train_steps=100"]
STEPS = 12


def run(exp_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The uninterrupted run (the reference, or the rerun after a stop) in a process forked from the session's server
    (``train_forked``); the signalled runs are real processes (``interrupt``)."""
    return train_forked(exp_dir, *COMMON, f"trainer.max_steps={STEPS}", *overrides, timeout=600)


def interrupt(
    exp_dir: Path,
    signum: int,
    *overrides: str,
    launcher: tuple[str, ...] = (),
    one_worker: bool = False,
    wait_s: float = 120,
) -> tuple[int, str, float]:
    """Start a 1000-step run, send ``signum`` to its whole process group once 3 steps are logged (as a terminal's
    Ctrl+C or a scheduler does), or to one worker of the launcher only; returns the exit status, the output and the
    seconds the run took to stop."""
    cmd = train_cmd(exp_dir, *COMMON, "trainer.max_steps=1000", *overrides)
    if launcher:
        cmd = [sys.executable, *launcher, *cmd[3:]]  # after `python -m neva.train`
    log = exp_dir.parent / f"{exp_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (exp_dir / "metrics.csv").exists() and max(read_losses(exp_dir), default=0) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, log.read_text()[-3000:]
        sent = time.time()
        if one_worker:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            os.kill(int(children[-1]), signum)
        else:
            os.killpg(proc.pid, signum)
        try:
            code = proc.wait(timeout=wait_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text(), time.time() - sent


def saved_step(last: Path) -> int:
    """The step of a checkpoint file, or of a DCP directory (whose loop state is a file beside the shards)."""
    state = last / _METADATA_FILENAME if last.is_dir() else last
    return torch.load(state, map_location="cpu", weights_only=False)["global_step"]


def assert_same_curve(exp_dir: Path, reference: dict[int, float], rel: float) -> None:
    """Every step of ``reference`` trained once in ``exp_dir``, with the same loss."""
    resumed = read_losses(exp_dir)
    assert sorted(resumed) == sorted(reference)
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=rel), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    exp_dir = tmp_path_factory.mktemp("reference") / "run"
    done = run(exp_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = read_losses(exp_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1], ids=["SIGTERM", "SIGINT", "SIGUSR1"]
)
def test_signal_stops_at_a_step_with_a_checkpoint_and_the_rerun_continues_the_curve(reference, tmp_path, signum):
    exp_dir = tmp_path / "run"
    code, output, took = interrupt(exp_dir, signum)
    assert code == 128 + signum, output[-3000:]
    assert took < 60, took
    reached = max(read_losses(exp_dir))
    assert 3 <= reached < STEPS, reached
    name = signal.Signals(signum).name
    assert f"stopped by {name} after step {reached}" in output, output[-3000:]
    assert f"(exit status {128 + signum})" in output
    last = exp_dir / "checkpoints" / "last.ckpt"
    assert saved_step(last) == reached  # the checkpoint is the step the run reached: nothing trained is lost
    assert not (exp_dir / "final").exists()  # the run did not finish what was asked

    again = run(exp_dir)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_same_curve(exp_dir, reference, rel=1e-6)
    assert (exp_dir / "final").is_dir()


@pytest.mark.parametrize("one_worker", [False, True], ids=["process-group", "one-rank"])
def test_every_torchrun_rank_stops_after_the_same_step(reference, tmp_path, one_worker):
    """DP2 under torchrun. SIGTERM to the whole process group (each rank gets it twice: directly and forwarded by the
    launcher), or to one rank only: the ranks agree on the step, write one DCP checkpoint of it, and one process
    continues the one-process curve from it."""
    exp_dir = tmp_path / "run"
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "neva.train")
    # micro-batches of 8 on each of 2 ranks: the one-process run's global batch of 32 in 2 accumulation steps
    code, output, took = interrupt(
        exp_dir, signal.SIGTERM, "model.micro_batch_size=8", launcher=torchrun, one_worker=one_worker
    )
    assert code != 0, output[-3000:]
    assert took < 60, took
    reached = max(read_losses(exp_dir))
    assert 3 <= reached < STEPS, reached
    assert output.count(f"stopped by SIGTERM after step {reached}") == 1, output[-3000:]  # logged by rank 0
    assert output.count("SIGTERM received: stopping after this step") == (1 if one_worker else 2), output[-3000:]
    if one_worker:  # the launcher itself was not signalled: the first rank to finish ends with the documented status
        # (the launcher then stops the other one, which may still be on its way out after the shared checkpoint)
        assert output.count("exitcode  : 143") >= 1, output[-3000:]
    last = exp_dir / "checkpoints" / "last.ckpt"
    assert last.is_dir() and saved_step(last) == reached
    assert not (exp_dir / "final").exists()

    again = run(exp_dir)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_same_curve(exp_dir, reference, rel=1e-5)


def test_torchrun_restarts_a_killed_group_that_resumes_and_finishes_the_curve(reference, tmp_path):
    """kill -9 of one rank under ``torchrun --max-restarts=1``: the launcher restarts the group, which rendezvouses
    afresh (neva/parallel/elastic_restart.py), resumes from the last periodic checkpoint and finishes with the
    one-process curve."""
    exp_dir = tmp_path / "run"
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1", "-m", "neva.train")
    code, output, _ = interrupt(
        exp_dir,
        signal.SIGKILL,
        "model.micro_batch_size=8",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
        f"trainer.max_steps={STEPS}",
        launcher=torchrun,
        one_worker=True,
        wait_s=300,
    )
    assert code == 0, output[-3000:]
    assert "resuming from" in output, output[-3000:]  # the restarted group, from a periodic checkpoint
    assert_same_curve(exp_dir, reference, rel=1e-5)
    assert (exp_dir / "final").is_dir()
