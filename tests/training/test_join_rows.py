"""Packed rows joined into one row of their real tokens (``neva.data.micro_batch.MicroBatch.joined``, the engine's path where
attention runs per segment): the rows' loss and gradients, without computing their padding."""

import pytest
import torch

from tests.training.conftest import micro_batches
from tests.training.test_semantics import make_engine

FINETUNE = ["model.restore_from_path=null", "model.mm_cfg.llm.freeze=false", "model.data.conv_template=vicuna_v1"]


def test_join_rows_keeps_every_real_token_and_sample(lean_cfg):
    cfg = lean_cfg(*FINETUNE, "model.data.packing=true", "model.data.seq_length=512")
    _, (batch,) = micro_batches(cfg, 1, 8)
    seg = batch.segment_ids
    assert seg.shape[0] > 1 and (seg == 0).any()  # several rows, padding at their ends
    joined = batch.joined()
    real = seg > 0
    assert joined.input_ids.shape == (1, int(real.sum()))
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(joined, key)[..., 0, :], getattr(batch, key)[..., real])  # positions: [P, B, S]
    # One segment per sample, in order: samples of neighbouring rows stay apart even when both have id 1.
    assert joined.segment_ids.max() == batch.counts.num_samples
    assert torch.equal(joined.segment_ids[0].unique_consecutive(), torch.arange(1, batch.counts.num_samples + 1))
    for old, new in (
        (batch.media.image.positions, joined.media.image.positions),
        (batch.output_positions, joined.output_positions),
    ):
        assert (new[:, 0] == 0).all()
        assert torch.equal(joined.input_ids[0, new[:, 1]], batch.input_ids[old[:, 0], old[:, 1]])
    assert torch.equal(joined.targets, batch.targets)
    assert joined.media.image.items_per_row.tolist() == [int(batch.media.image.items_per_row.sum())]


def test_joined_rows_give_the_rows_loss_and_gradients(lean_cfg):
    """With LoRA dropout: its per-token keys (made on the rows) follow their tokens into the joined row."""
    lora = ["model.peft.peft_scheme=lora", "model.peft.lora_tuning.adapter_dropout=0.3"]
    cfg = lean_cfg(*FINETUNE, *lora, "model.data.packing=true", "model.data.seq_length=512")
    source, batches = micro_batches(cfg, 1, 8)
    results = []
    for join in (False, True):
        engine = make_engine(cfg, source)
        assert engine.join_rows  # packed, one process, CPU
        engine.join_rows = join
        loss, tokens = engine.forward_backward(batches)
        grads = {n: p.grad for n, p in engine.named_trainable_parameters()}
        results.append((loss.item(), tokens.item(), grads))
    (loss_rows, tok_rows, g_rows), (loss_joined, tok_joined, g_joined) = results
    assert tok_rows == tok_joined
    assert loss_joined == pytest.approx(loss_rows, rel=1e-6)
    for name, grad in g_rows.items():
        torch.testing.assert_close(g_joined[name], grad, rtol=1e-5, atol=1e-7, msg=name)
