"""The training loader: worker count does not change training; ``metrics.csv`` reports the data-wait share."""

import csv

import pytest

from neva.data.datamodule import MAX_AUTO_WORKERS, resolve_num_workers
from neva.training.run import run


def test_auto_workers_are_zero_on_cpu_and_follow_the_cpus_per_rank_on_cuda(monkeypatch):
    assert resolve_num_workers("auto", "cpu") == 0
    assert resolve_num_workers(3, "cpu") == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_num_workers("auto", "cuda") == 3  # 4 CPUs per rank, one kept for the training loop
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resolve_num_workers("auto", "cuda") == MAX_AUTO_WORKERS


def test_same_loss_curve_with_persistent_workers_and_data_wait_in_metrics(lean_cfg, tmp_path):
    """Two workers (persistent, prefetching, reused by every validation) train the curve of the in-process loader."""
    curves = {}
    for workers in (0, 2):
        exp = tmp_path / f"workers{workers}"
        cfg = lean_cfg(
            f"model.data.num_workers={workers}", "trainer.max_steps=4", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", f"exp_manager.exp_dir={exp}",
        )  # fmt: skip
        run(cfg)
        with open(exp / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
        assert len(rows) == 4
        assert all(0.0 <= float(r["data_wait_fraction"]) <= 1.0 for r in rows)
        curves[workers] = [(float(r["train_loss"]), float(r["grad_norm"])) for r in rows]
    assert curves[2] == curves[0]


def test_num_workers_must_be_auto_or_a_count(lean_cfg):
    with pytest.raises(ValueError, match="num_workers"):
        lean_cfg("model.data.num_workers=many")
