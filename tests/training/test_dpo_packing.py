"""Packed preference pairs (``model.data.packing=true`` in the DPO stage): the chosen and rejected sequences of a
micro-batch's pairs packed into shared rows give the step of the unpacked pairs (a row each) — the loss, every
reward and log-prob metric and the gradient norm within 1e-6 relative, two steps (the second's policy has moved
from the reference); and the batch packs (fewer rows than sequences)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.harness import train_losses

STEPS = 2


def test_packed_pairs_equal_unpacked(tiny_checkpoint):
    torch.set_num_threads(1)
    base = [
        "+stage=dpo", f"model.restore_from_path={tiny_checkpoint}", "model.micro_batch_size=4",
        "model.global_batch_size=8", "model.data.synthetic_train_samples=16", "model.data.synthetic_val_samples=4",
        "model.data.pad_to_multiple_of=8", "model.data.num_workers=0", "model.optim.sched.warmup_steps=0",
        "trainer.max_steps=2", "model.dpo.sft_weight=0.5",
    ]  # fmt: skip
    unpacked = train_losses([], STEPS, base=base)
    packed = train_losses(["model.data.packing=true"], STEPS, base=base, keep_engine=True)
    batch = next(iter(packed.pop("data").train_dataloader()))
    assert batch.input_ids.shape[0] < 2 * batch.stage.pairs  # the pairs' sequences share rows
    for key in ("losses", "grad_norms"):
        for got, want in zip(packed[key], unpacked[key]):
            assert got == pytest.approx(want, rel=1e-6), key
    assert unpacked["aux_metrics"][1]["rewards/margin"] != 0  # the second step's policy is not the reference
    for got, want in zip(packed["aux_metrics"], unpacked["aux_metrics"]):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-7), name
