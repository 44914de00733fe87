"""``model.loss_normalization=micro_batch_mean`` over two data-parallel gloo processes (and a two-stage pipeline,
whose loss function weighs each micro-batch from its own labels) equals one process on the same micro-batches.

The one-process objective is checked against the hand-computed mean of micro-batch means in
``tests/training/test_loss_normalization.py``; here the averaging over ranks is: DP2 with micro-batch 2 and global
batch 8 runs the same four micro-batches per step as one process (rank r takes the r-th of each pair).
"""

from __future__ import annotations

import pytest

from .harness import make_checkpoint, run_layouts, train_losses

pytestmark = pytest.mark.slow

STEPS = 2
LAYOUTS = {"dp2_ddp": ["model.data_parallel=ddp"], "pp2": ["model.pipeline_model_parallel_size=2"]}


def test_micro_batch_mean_over_ranks_equals_one_process(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt" / "tiny")
    common = [f"model.restore_from_path={ckpt}", "model.loss_normalization=micro_batch_mean"]
    ref = train_losses(common, STEPS)["losses"]
    results = run_layouts(2, [(name, common + o, STEPS) for name, o in LAYOUTS.items()], tmp_path / "runs")
    for name in LAYOUTS:
        for rank in results:
            got = rank[name]["losses"]
            assert max(abs(a - b) / b for a, b in zip(got, ref)) < 1e-5, (name, got, ref)
