"""Single process: predicted parameter / gradient / AdamW bytes equal the real ones after one step, exactly."""

from __future__ import annotations

import pytest

from neva.planner.memory import rank_state_bytes
from neva.planner.params import local_numel, stage_layers
from tests.planner.helpers import batch, deployment, measured_bytes, tiny_inventory, tiny_model, train_step


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_single_process_state_bytes_are_exact(stage: str) -> None:
    model = tiny_model(stage)
    opt = train_step(model, *batch(model))
    real = measured_bytes(model, opt)

    dep = deployment()
    infos = tiny_inventory(stage)
    predicted = rank_state_bytes(infos, dep, 0, stage_layers(model.cfg.llm.num_layers, dep.layout))
    assert (predicted.params, predicted.grads, predicted.optimizer) == (
        real["params"],
        real["grads"],
        real["optimizer"],
    )


def test_frozen_parts_have_no_grads_or_optimizer_state() -> None:
    infos = tiny_inventory("pretrain")
    trainable = {p.part for p in infos if p.trainable}
    assert trainable == {"projector"}
    dep = deployment()
    state = rank_state_bytes(infos, dep, 0, stage_layers(4, dep.layout))
    projector = sum(p.numel for p in infos if p.part == "projector")
    assert state.grads == 4 * projector
    assert state.optimizer == 8 * projector + 4 * sum(1 for p in infos if p.trainable)


def test_o2_bytes_per_element() -> None:
    """O2: 2 (bf16) + 4 (master) + 4 (grad) + 8 (Adam) per trained element; frozen bf16 only; FSDP (distributed runs)
    drops the bf16 copy: its sharded fp32 parameters are the masters, and frozen shards stay fp32 too."""
    infos = tiny_inventory("finetune")
    trained = sum(p.numel for p in infos if p.trainable)
    frozen = sum(p.numel for p in infos if not p.trainable)
    tensors = sum(1 for p in infos if p.trainable)
    ddp = rank_state_bytes(infos, deployment(data_parallel="ddp", precision="o2"), 0, [list(range(4))])
    assert ddp.params == 6 * trained + 2 * frozen
    assert ddp.grads == 4 * trained
    assert ddp.optimizer == 8 * trained + 4 * tensors
    # One process: training keeps fp32 master copies (no FSDP to hold them), whatever data_parallel says.
    single = rank_state_bytes(infos, deployment(data_parallel="fsdp", precision="o2"), 0, [list(range(4))])
    assert single.params == ddp.params
    dep = deployment(dp=2, data_parallel="fsdp", precision="o2")
    fsdp = rank_state_bytes(infos, dep, 0, [list(range(4))])
    shard = {t: sum(local_numel(p, dep.layout) for p in infos if p.trainable == t) for t in (True, False)}
    # FSDP2 keeps frozen shards fp32 as well (the rehearsal's measurement, tests/training/test_rehearsal.py).
    assert fsdp.params == 4 * shard[True] + 4 * shard[False]
