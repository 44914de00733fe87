"""Resuming ``python -m neva.train`` with another config, as users do: a precision change continues the curve, a new
learning rate is applied and logged, and changes that alter what is trained stop the run before anything is written."""

import csv
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neva.config import compose_config
from neva.training.optim import cosine_lr_lambda
from tests.training.conftest import LEAN
from tests.training.test_cli import ENV, read_losses, train_cmd, train_forked

pytestmark = pytest.mark.slow

SIX = [
    "trainer.max_steps=6",
    "trainer.log_every_n_steps=1",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=6",
]
TWELVE = [o.replace("max_steps=6", "max_steps=12") for o in SIX]
O2 = ["trainer.precision=bf16-mixed", "model.megatron_amp_O2=true"]


def train(exp_dir: Path, *overrides: str, stage: str = "pretrain") -> subprocess.CompletedProcess:
    return train_forked(exp_dir, *overrides, stage=stage)


def train_process(exp_dir: Path, *overrides: str, stage: str = "pretrain") -> subprocess.CompletedProcess:
    """The command in its own interpreter: a refusal's exit status is the process's."""
    return subprocess.run(
        train_cmd(exp_dir, *overrides, stage=stage), capture_output=True, text=True, env=ENV, timeout=300
    )


def column(exp_dir: Path, name: str) -> dict[int, float]:
    with open(exp_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def digest(exp_dir: Path) -> dict[str, str]:
    """Every file of a run folder with its content hash (Hydra's per-launch log folders aside)."""
    files = (p for p in sorted(exp_dir.rglob("*")) if p.is_file() and "hydra" not in p.parts)
    return {str(p.relative_to(exp_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A finished 6-step fp32 pretraining run (checkpoint at step 6); tests resume copies of it."""
    exp_dir = tmp_path_factory.mktemp("six") / "run"
    done = train(exp_dir, *SIX)
    assert done.returncode == 0, done.stderr[-2000:]
    return exp_dir


def copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_fp32_checkpoint_resumed_under_o2_continues_the_curve(six_steps, tmp_path):
    fp32 = train(copy(six_steps, tmp_path / "fp32"), *TWELVE)
    assert fp32.returncode == 0, fp32.stderr[-2000:]
    o2 = train(copy(six_steps, tmp_path / "o2"), *TWELVE, *O2)
    assert o2.returncode == 0, o2.stderr[-2000:]
    logged = o2.stdout + o2.stderr
    assert 'trainer.precision: "32" → "bf16-mixed"' in logged and "model.megatron_amp_O2: false → true" in logged
    reference, resumed = read_losses(tmp_path / "fp32"), read_losses(tmp_path / "o2")
    assert sorted(resumed) == list(range(1, 13))
    # The O2 masters start from the trained weights: every resumed step follows the fp32 curve (bf16 compute), far
    # below the first step's loss, where a reset to the initial weights sends it (6.5 at step 8 before the fix).
    for step in range(7, 13):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-2), (step, resumed, reference)
        assert resumed[step] < reference[1] - 1.0, (step, resumed)
    # In the copied folder the checkpoints keep their names (no last-v1.ckpt beside a stale last.ckpt).
    checkpoints = tmp_path / "o2" / "checkpoints"
    assert not [p.name for p in checkpoints.iterdir() if "-v" in p.name]
    saved = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 12
    masters = saved["master_weights"]

    # Back to fp32, one step at lr 0 (weights unchanged): the weights are O2's fp32 masters, not their bf16 copies.
    back = train(tmp_path / "o2", *TWELVE, "trainer.max_steps=13", "model.optim.lr=0", "model.optim.sched.min_lr=0")
    assert back.returncode == 0, back.stderr[-2000:]
    final = load_file(tmp_path / "o2" / "final" / "model.safetensors")
    assert masters and all(torch.equal(final[name], value) for name, value in masters.items())
    assert any(not torch.equal(value.bfloat16().float(), value) for value in masters.values())


def test_changed_lr_is_applied_from_the_saved_step_and_logged(six_steps, tmp_path):
    run = copy(six_steps, tmp_path / "lr")
    before = column(run, "lr")
    done = train(run, *TWELVE, "model.optim.lr=1e-3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "model.optim.lr: 0.002 → 0.001" in done.stdout + done.stderr
    assert "trainer.max_steps: 6 → 12" in done.stdout + done.stderr
    lrs = column(run, "lr")
    assert {s: lrs[s] for s in range(1, 7)} == before  # the rows of the first six steps are kept
    # Step s trains with the rate of scheduler step s - 1 of the new config's schedule.
    optim = compose_config(["+stage=pretrain", *LEAN, *TWELVE, "model.optim.lr=1e-3"]).model.optim
    factor = cosine_lr_lambda(optim, 12, 1e-3)
    for step in range(7, 13):
        assert lrs[step] == pytest.approx(1e-3 * factor(step - 1), rel=1e-9), (step, lrs)


def test_changes_that_alter_what_is_trained_stop_before_anything_is_written(six_steps, tmp_path):
    run = copy(six_steps, tmp_path / "changed")
    before = digest(run)
    refused = train_process(
        run, *TWELVE, "model.global_batch_size=16", "model.seed=7", "model.data.synthetic_train_samples=96"
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    for line in (
        "checkpoints/last.ckpt was written with another config, and these changes alter what is trained:",
        "model.global_batch_size: 32 → 16",
        "model.seed: 1234 → 7",
        "model.data.synthetic_train_samples: 120 → 96",
        "exp_manager.resume_ignore_config_changes=true",
    ):
        assert line in refused.stderr, refused.stderr[-2000:]
    assert "trainer.max_steps" not in refused.stderr  # a safe change is not in the list
    assert digest(run) == before  # nothing trained, nothing written, nothing lost

    # The finetune stage pointed at the pretrain folder (starting from its final weights) resumes its checkpoint.
    as_finetune = train_process(run, *TWELVE, f"model.restore_from_path={run / 'final'}", stage="finetune")
    assert as_finetune.returncode == 2 and 'stage: "pretrain" → "finetune"' in as_finetune.stderr
    assert "optimizer" not in as_finetune.stderr.lower()
    assert digest(run) == before

    accepted = train(
        run, *TWELVE, "model.global_batch_size=16", "model.data.synthetic_train_samples=96",
        "exp_manager.resume_ignore_config_changes=true",
    )  # fmt: skip
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    logged = accepted.stdout + accepted.stderr
    for change in ("model.global_batch_size: 32 → 16", "model.data.synthetic_train_samples: 120 → 96"):
        assert f"accepted by exp_manager.resume_ignore_config_changes=true: {change}" in logged, logged[-3000:]
    assert sorted(read_losses(run)) == list(range(1, 13))


def test_the_bar_counts_steps_from_the_resumed_one(six_steps, tmp_path):
    """The bar counts optimizer steps towards max_steps from the resumed step; before, a run resumed inside an epoch
    showed its steps over an unknown total ("106/?"). A real process: the bar writes to its stdout."""
    done = train_process(
        copy(six_steps, tmp_path / "bar"), *SIX, "trainer.max_steps=8", "trainer.enable_progress_bar=true"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 6/8 [" in done.stdout and not re.search(r"/\? \[[^\]]*loss=", done.stdout), done.stdout[-2000:]
