"""``trainer.max_epochs``: the step count follows the data (a one-epoch recipe stays one epoch on any data), and with
``trainer.max_steps`` also set, whichever limit comes first ends the run (Lightning's and NeMo's rule)."""

from __future__ import annotations

import csv

import pytest

from neva.checkpoint.source import resolve_source
from neva.config import TrainerConfig
from neva.data.datamodule import NevaDataModule
from neva.training.guards import plan_steps, plan_training_data
from tests.data.conftest import write_jsonl
from tests.training.test_guards import llava, printed_final, run, text_records


@pytest.mark.parametrize(
    ("max_steps", "max_epochs", "steps"), [(-1, 1, 2), (-1, 3, 6), (5, 3, 5), (7, 3, 6), (4, -1, 4)]
)
def test_steps_from_epochs_on_llava_format_data(lean_cfg, tmp_path, max_steps, max_epochs, steps):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, text_records(70))  # global batch 32: 2 whole steps per epoch, 6 samples left over
    cfg = lean_cfg(*llava(path), f"trainer.max_steps={max_steps}", f"trainer.max_epochs={max_epochs}")
    source = resolve_source(cfg)
    data = NevaDataModule(
        cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=cfg.model.micro_batch_size, accumulation=2
    )
    plan_training_data(data)
    assert plan_steps(cfg.trainer, data) == steps


def test_limits_that_would_never_end_or_train_nothing_are_refused():
    with pytest.raises(ValueError, match="never end"):
        TrainerConfig(max_steps=-1, max_epochs=-1)
    with pytest.raises(ValueError, match="max_epochs"):
        TrainerConfig(max_steps=-1, max_epochs=0)
    with pytest.raises(ValueError, match="max_steps"):
        TrainerConfig(max_steps=0)


def test_an_epoch_run_trains_its_epochs_and_decays_over_them(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, text_records(70))
    exp = tmp_path / "exp"
    out = run(exp, *llava(path), "trainer.max_steps=-1", "trainer.max_epochs=2", "trainer.log_every_n_steps=1",
              "model.optim.sched.warmup_steps=0")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert printed_final(out)
    assert "one epoch = 2 optimizer steps (70 samples, global batch 32)" in out.stdout + out.stderr
    with open(exp / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    # The cosine schedule runs over the 4 planned steps: lr at step 4 (3/4 of the way) is min + (lr - min)·(1 + cos(3π/4))/2.
    lr, min_lr = 2e-3, 2e-5
    expected = min_lr + (lr - min_lr) * 0.5 * (1 - 2**-0.5)
    assert float(rows[-1]["lr"]) == pytest.approx(expected, rel=1e-4)
