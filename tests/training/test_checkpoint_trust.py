"""Training checkpoints are verified before they are trusted (``neva.checkpoint.verified``), as a user meets them:
``python -m neva.train`` rerun over a folder whose checkpoints were planted, bit-flipped, truncated or deleted."""

import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from neva.checkpoint.verified import file_digest, write_manifest
from tests.training.test_cli import ENV, read_losses, train_cmd, train_forked

COMMON = [
    "trainer.log_every_n_steps=1",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=1",
    "exp_manager.checkpoint_callback_params.save_top_k=2",
]


def train(run_dir: Path, max_steps: int, *overrides: str, process: bool = False) -> subprocess.CompletedProcess:
    """``python -m neva.train`` on ``run_dir``; ``.output`` holds stdout and stderr together (Hydra logs to one,
    Python's warnings and tracebacks go to the other). Forked from the session's server (``train_forked``), or
    (``process``: a refusal, whose exit status is the process's) in its own interpreter."""
    overrides = (*COMMON, f"trainer.max_steps={max_steps}", *overrides)
    if process:
        out = subprocess.run(train_cmd(run_dir, *overrides), capture_output=True, text=True, env=ENV, timeout=300)
    else:
        out = train_forked(run_dir, *overrides)
    out.output = out.stdout + out.stderr
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 4-step run checkpointed every step, keeping 2 step checkpoints; its ``final`` removed so that a test can
    tell whether a rerun wrote one."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    done = train(run_dir, 4)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(run_dir / "final")
    return run_dir


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def snapshot(run_dir: Path) -> dict[str, str]:
    """sha256 of every file under the run folder: what a failed rerun must leave untouched."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and "hydra" not in p.parts
    }


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


class Payload:
    """Pickles as a call of ``os.system``: what a planted checkpoint would run when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def assert_refused_untouched(out, before, run_dir, *words):
    assert out.returncode != 0
    for word in words:
        assert word in out.output, out.output[-3000:]
    assert snapshot(run_dir) == before  # nothing trained, written or lost
    assert not (run_dir / "final").exists()


def test_top_k_newest_step_checkpoints_each_with_a_manifest(trained):
    names = sorted(p.name for p in (trained / "checkpoints").iterdir())
    ckpts = ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]
    assert names == sorted(ckpts + [n + ".manifest.json" for n in ckpts])
    assert sorted(read_losses(trained)) == [1, 2, 3, 4]


def test_planted_pickle_in_last_ckpt_is_refused_not_run(run_dir, tmp_path):
    marker = tmp_path / "pwned"
    last = run_dir / "checkpoints" / "last.ckpt"
    torch.save({"global_step": 9, "x": Payload(marker)}, last)
    # A manifest that matches: checksums catch damage, not malice; the unpickler is what refuses.
    write_manifest(last, {last.name: file_digest(last)}, step=9)
    torch.load(last, weights_only=False)  # the payload is live: the old loader would have run it
    assert marker.exists()
    marker.unlink()
    before = snapshot(run_dir)

    out = train(run_dir, 6, process=True)
    assert_refused_untouched(out, before, run_dir, "last.ckpt", "not tensors or plain data", "posix.system")
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["meta.pt", ".metadata"])
def test_planted_pickle_in_dcp_directory_is_refused_not_run(run_dir, tmp_path, planted):
    """A DCP checkpoint directory (what distributed runs write; one process resumes them too) whose loop-state
    file ``meta.pt`` or DCP's own ``.metadata`` pickle carries a payload."""
    marker = tmp_path / "pwned"
    ckpts = run_dir / "checkpoints"
    last = ckpts / "last.ckpt"
    last.unlink()
    (ckpts / "last.ckpt.manifest.json").unlink()
    last.mkdir()
    shutil.copy(ckpts / "step=4.ckpt", last / "meta.pt")  # genuine loop state
    if planted == "meta.pt":
        torch.save({"global_step": 9, "x": Payload(marker)}, last / "meta.pt")
    else:
        (last / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    write_manifest(last, {p.name: file_digest(p) for p in last.iterdir()}, step=9)
    before = snapshot(run_dir)

    out = train(run_dir, 6, process=True)
    assert_refused_untouched(out, before, run_dir, planted, "posix.system")
    assert not marker.exists()


def test_bit_flips_fall_back_to_the_newest_intact_step_checkpoint(run_dir):
    """``last.ckpt`` and ``step=4.ckpt`` bit-flipped: the run resumes from ``step=3.ckpt`` with a warning naming both,
    recomputes step 4 exactly as the first run did, and rewrites ``step=4.ckpt`` under its own name."""
    ckpts = run_dir / "checkpoints"
    first = read_losses(run_dir)
    flip_byte(ckpts / "last.ckpt")
    flip_byte(ckpts / "step=4.ckpt")

    out = train(run_dir, 5)
    assert out.returncode == 0, out.output[-3000:]
    assert f"resuming from {ckpts / 'step=3.ckpt'}" in out.output
    for name in ("last.ckpt", "step=4.ckpt"):
        assert f"{name}: does not match the sha256 of its manifest" in out.output
    resumed = read_losses(run_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    for step in (1, 2, 3, 4):
        assert resumed[step] == pytest.approx(first[step], rel=1e-6), step
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt", "step=4.ckpt", "step=5.ckpt"]
    assert (run_dir / "final").is_dir()


def test_truncated_last_falls_back_to_the_step_checkpoint_beside_it(run_dir):
    last = run_dir / "checkpoints" / "last.ckpt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 3])
    first = read_losses(run_dir)

    out = train(run_dir, 5)
    assert out.returncode == 0, out.output[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'step=4.ckpt'}" in out.output
    assert "(truncated?)" in out.output
    resumed = read_losses(run_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert all(resumed[s] == first[s] for s in (1, 2, 3, 4))


def test_without_last_ckpt_resume_finds_step_checkpoints_and_stale_temp_files_go(run_dir):
    """``save_last=false`` (or ``last.ckpt`` deleted): the rerun resumes from the newest ``step=N.ckpt`` instead of
    starting over and overwriting ``metrics.csv``; the full-size temp file of a killed save is removed at start."""
    ckpts = run_dir / "checkpoints"
    (ckpts / "last.ckpt").unlink()
    (ckpts / "last.ckpt.manifest.json").unlink()
    stale = ckpts / ".step=5.ckpt.k1ll3d.tmp"
    shutil.copy(ckpts / "step=4.ckpt", stale)
    first = read_losses(run_dir)

    out = train(run_dir, 5, "exp_manager.checkpoint_callback_params.save_last=false")
    assert out.returncode == 0, out.output[-3000:]
    assert f"resuming from {ckpts / 'step=4.ckpt'}" in out.output
    assert not stale.exists()
    resumed = read_losses(run_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert all(resumed[s] == first[s] for s in (1, 2, 3, 4))
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["step=4.ckpt", "step=5.ckpt"]


def test_no_intact_checkpoint_stops_instead_of_starting_over(run_dir):
    ckpts = run_dir / "checkpoints"
    flip_byte(ckpts / "last.ckpt")
    flip_byte(ckpts / "step=4.ckpt")
    (ckpts / "step=3.ckpt.manifest.json").unlink()  # as if killed between the file and its manifest
    before = snapshot(run_dir)

    out = train(run_dir, 6, process=True)
    assert_refused_untouched(
        out, before, run_dir, "none is intact", "refusing to start over it from step 0", "step=3.ckpt: no manifest"
    )


def kill_during_save(run_dir: Path, max_steps: int, prefix: str, after_step: int) -> dict[int, float]:
    """Start the run and SIGKILL it while a save's temp file ``.{prefix}*.tmp`` exists (after ``after_step``);
    returns the losses it had written."""
    cmd = train_cmd(run_dir, *COMMON, f"trainer.max_steps={max_steps}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, start_new_session=True)
    ckpts, caught = run_dir / "checkpoints", []
    deadline = time.time() + 240
    while not caught and proc.poll() is None and time.time() < deadline:
        if (run_dir / "metrics.csv").exists() and max(read_losses(run_dir), default=0) > after_step:
            caught = [n for n in os.listdir(ckpts) if n.startswith(prefix) and n.endswith(".tmp")]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert caught, f"no save of {prefix}* was caught in flight"
    return read_losses(run_dir)


@pytest.mark.slow
def test_kill_during_saves_never_loses_a_valid_checkpoint(tmp_path):
    """SIGKILL while ``step=N.ckpt`` is being written, then while ``last.ckpt`` is (its old manifest already gone):
    each rerun removes the temp file, resumes from the newest intact checkpoint and recomputes exactly the steps the
    killed run had logged, and the last rerun finishes the curve."""
    run_dir = tmp_path / "run"
    legs = [kill_during_save(run_dir, 9, ".step=", after_step=2)]
    legs.append(kill_during_save(run_dir, 9, ".last.ckpt", after_step=max(legs[0]) + 1))
    done = train(run_dir, 9)
    assert done.returncode == 0, done.output[-3000:]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    final = read_losses(run_dir)
    assert sorted(final) == list(range(1, 10))
    for leg in legs:
        for step, loss in leg.items():
            assert final[step] == pytest.approx(loss, rel=1e-6), step
