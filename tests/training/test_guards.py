"""Runs that did not train what was asked never exit 0: guards before training, checks before ``final``.

The exit code is the behaviour, so these run ``python -m neva.train`` in subprocesses on LLaVA-format files (text-only
records, so no images are needed); the all-masked step is checked in process, through a real Lightning fit.
"""

from __future__ import annotations

import copy
import csv
import json
import subprocess
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from neva.checkpoint.source import resolve_source
from neva.data.datamodule import NevaDataModule
from neva.data.sampler import ResumableBatchSampler
from neva.parallel.layout import resolve_layout
from neva.parallel.strategy import build_strategy
from neva.training.callbacks import MetricsCSV
from neva.training.module import NevaModule
from tests.data.conftest import qa, write_jsonl
from tests.training.test_cli import ENV, train_cmd

BAD = {"id": "bad", "conversations": []}  # skipped as empty_conversation


def text_records(n: int, bad: set[int] = frozenset(), long: set[int] = frozenset()) -> list[dict]:
    """``n`` text-only records; those in ``bad`` are skipped, those in ``long`` are cut to the sequence length."""
    out = []
    for i in range(n):
        if i in bad:
            out.append({**BAD, "id": f"bad{i}"})
        else:
            answer = "A red circle on the left. " * (20 if i in long else 1)
            out.append(qa(image=None, q="What is it?", a=answer.strip(), rid=f"good{i}"))
    return out


def llava(path: Path, *extra: str) -> list[str]:
    # The LLM trains: text-only batches give the projector (all pretraining trains by default) no gradient.
    return ["data=llava", f"model.data.data_path={path}", "model.data.image_folder=null", "model.data.num_workers=0",
            "model.data.group_by_modality_length=false", "model.mm_cfg.llm.freeze=false", *extra]  # fmt: skip


def run(exp_dir: Path, *overrides: str, stage: str = "pretrain") -> subprocess.CompletedProcess:
    return subprocess.run(
        train_cmd(exp_dir, *overrides, stage=stage), capture_output=True, text=True, env=ENV, timeout=300
    )


def printed_final(out: subprocess.CompletedProcess) -> bool:
    """Whether the run printed a final checkpoint's path (its last stdout line when it succeeds)."""
    lines = out.stdout.strip().splitlines()
    return bool(lines) and lines[-1].endswith("final")


def earlier_run(exp_dir: Path) -> dict[Path, bytes]:
    """A ``final`` and a ``metrics.csv`` left by an earlier run in ``exp_dir``: what a failed run must not touch."""
    (exp_dir / "final").mkdir(parents=True)
    files = {
        exp_dir / "final" / "config.json": b'{"earlier": true}',
        exp_dir / "metrics.csv": b"step,train_loss\n1,5\n",
    }
    for path, data in files.items():
        path.write_bytes(data)
    return files


def test_llava_data_without_data_path_fails_naming_the_key(tmp_path):
    """Item 1: the `???` of data=llava is not overridden by the root default (the built-in synthetic set)."""
    (tmp_path / "images").mkdir()
    out = run(tmp_path / "ft", "data=llava", f"model.data.image_folder={tmp_path / 'images'}", stage="finetune")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "model.data.data_path" in out.stderr and "image_folder" not in out.stderr.split("config error")[-1]
    assert not printed_final(out) and not (tmp_path / "ft" / "final").exists()
    out = run(tmp_path / "pt", "data=llava", f"model.data.data_path={tmp_path / 'x.json'}")
    assert out.returncode == 2 and "model.data.image_folder" in out.stderr


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["trainer.max_steps=0"], ["trainer.max_steps", "got 0"]),
        (["model.optim.lr=1e-4", "model.optim.sched.min_lr=1e-3"],
         ["model.optim.sched.min_lr=0.001", "model.optim.lr=0.0001"]),
    ],
)  # fmt: skip
def test_config_guards_fail_before_training(tmp_path, overrides, needles):
    """Item 2 (max_steps=0) and the fresh-run half of item 13 (min_lr > lr)."""
    kept = earlier_run(tmp_path)
    out = run(tmp_path, *overrides)
    assert out.returncode == 2, out.stderr[-2000:]
    for needle in needles:
        assert needle in out.stderr
    assert all(path.read_bytes() == data for path, data in kept.items())
    assert not (tmp_path / "checkpoints").exists() and not printed_final(out)


def test_fewer_samples_than_one_global_batch_fails_before_training(tmp_path):
    """Item 2: 20 samples fill one micro-batch of 16 but not the global batch of 32 (two micro-batches)."""
    path = tmp_path / "data.jsonl"
    write_jsonl(path, text_records(20))
    exp = tmp_path / "exp"
    kept = earlier_run(exp)
    out = run(exp, *llava(path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "20 samples cannot fill one global batch of 32" in out.stderr
    assert "micro_batch_size 16" in out.stderr and str(path) in out.stderr
    assert all(p.read_bytes() == data for p, data in kept.items())
    assert not (exp / "checkpoints").exists() and not printed_final(out)


def test_json_object_file_fails_naming_the_file(tmp_path):
    """Item 7: a top-level object is not read as one record."""
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": text_records(40), "version": 1}, indent=1))
    out = run(tmp_path / "exp", *llava(path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{path}: the top level is an object (keys: 'data', 'version')" in out.stderr
    assert "expected a JSON list" in out.stderr and not (tmp_path / "exp" / "final").exists()


def test_too_many_skips_stop_as_soon_as_certain_however_few_samples(tmp_path):
    """Item 3: 16 of 64 samples bad, far fewer than skip_check_min_samples (200). Issue 52: the run draws 64 samples
    (2 steps × 32), so its first micro-batch's skips already exceed 1% of them: bad input, exit 2, before a step is
    spent (it was the end-of-run check, exit 1, after every step)."""
    path = tmp_path / "data.jsonl"
    write_jsonl(path, text_records(64, bad=set(range(0, 64, 4))))
    exp = tmp_path / "exp"
    out = run(exp, *llava(path), "trainer.max_steps=2", "trainer.log_every_n_steps=1",
              "exp_manager.checkpoint_callback_params.every_n_train_steps=1")  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "samples skipped already, more than model.data.max_skip_fraction 1.00% of the 64 the run draws" in out.stderr
    assert "by reason: empty_conversation=" in out.stderr
    assert not (exp / "final").exists() and not printed_final(out)
    assert not (exp / "checkpoints" / "last.ckpt").exists()  # stopped before its first step


def test_a_run_without_an_optimizer_step_fails(tmp_path):
    """Item 2, its end: every sample skipped (allowed by max_skip_fraction=1), so every step is all-masked."""
    path = tmp_path / "data.jsonl"
    write_jsonl(path, text_records(64, bad=set(range(64))))
    exp = tmp_path / "exp"
    out = run(exp, *llava(path, "model.data.max_skip_fraction=1.0"), "trainer.max_steps=2")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "no optimizer step in 2 step(s)" in out.stderr and "empty_conversation=64" in out.stderr
    assert not (exp / "final").exists() and not printed_final(out)


class Snapshots(pl.Callback):
    """Trainable weights, AdamW state and schedule position after every step."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        self.steps.append({
            "weights": {n: p.detach().clone() for n, p in module.engine.named_trainable_parameters()},
            "adam": copy.deepcopy(optimizer.state_dict()["state"]),
            "sched": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "global_step": trainer.global_step,
        })  # fmt: skip


def test_all_masked_step_touches_neither_optimizer_nor_schedule(lean_cfg, tmp_path):
    """Item 4 (and item 6 in metrics.csv): step 2's global batch is all skipped samples."""
    n, micro = 12, 4
    write_jsonl(tmp_path / "data.jsonl", text_records(n))  # the config checks that the file exists
    cfg = lean_cfg(*llava(tmp_path / "data.jsonl", "model.data.max_skip_fraction=0.5", "model.data.seq_length=64"),
                   f"model.micro_batch_size={micro}",
                   f"model.global_batch_size={micro}", "trainer.max_steps=3", "trainer.log_every_n_steps=1")  # fmt: skip
    order = list(ResumableBatchSampler([n], micro, seed=cfg.model.seed))
    write_jsonl(tmp_path / "data.jsonl", text_records(n, bad=set(order[1]), long={order[0][0]}))

    layout = resolve_layout(cfg)
    source = resolve_source(cfg)
    data = NevaDataModule(cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=micro, seed=cfg.model.seed)
    metrics = MetricsCSV(tmp_path / "metrics.csv")
    module = NevaModule(cfg, source, data, layout, metrics=metrics)
    snaps = Snapshots()
    trainer = pl.Trainer(strategy=build_strategy(layout), devices=1, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[snaps], use_distributed_sampler=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(module)

    first, skipped, third = snaps.steps
    assert [s["global_step"] for s in snaps.steps] == [1, 2, 3]  # the skipped batch still counts as a step
    assert [s["sched"] for s in snaps.steps] == [1, 1, 2]
    for name, value in first["weights"].items():
        assert torch.equal(skipped["weights"][name], value), name
    assert first["adam"] and skipped["adam"].keys() == first["adam"].keys()
    for index, state in first["adam"].items():
        for key, value in state.items():
            assert torch.equal(skipped["adam"][index][key], value), (index, key)
    assert any(not torch.equal(third["weights"][k], v) for k, v in first["weights"].items())

    with open(tmp_path / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert [rows[s]["skipped_step"] for s in (1, 2, 3)] == ["0.0", "1.0", "0.0"]
    assert rows[2]["train_loss"] == "" and float(rows[2]["learned_tokens"]) == 0
    assert rows[1]["train_loss"] and rows[3]["train_loss"]
    assert float(rows[2]["data/skipped/empty_conversation"]) == micro
    assert float(rows[3]["data/truncated"]) == 1  # the long answer, cut to 64 tokens and trained on
