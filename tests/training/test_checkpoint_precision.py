"""Sharded (DCP) training checkpoints carry a run across precisions: fp32 parameters (what FSDP2 stores, O2 or not)
and one-process O2 (bf16 parameters + fp32 masters) read each other's checkpoints exactly."""

import torch

from neva.checkpoint import dcp
from neva.parallel.precision import Precision
from neva.training.optim import build_optimizer
from tests.training.conftest import micro_batches
from tests.training.test_semantics import make_engine

O2 = Precision.from_config("bf16-mixed", True)
FINETUNE = ["model.restore_from_path=null", "model.mm_cfg.llm.freeze=false", "model.data.conv_template=vicuna_v1"]


def _trained(cfg, source, batches, precision):
    engine = make_engine(cfg, source, precision)
    optimizer = build_optimizer(engine.named_trainable_parameters(), cfg.model.optim)
    engine.forward_backward(batches)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    engine.after_optimizer_step()
    return engine, optimizer


def _state(engine, optimizer):
    named = dict(engine.checkpoint_parameters())
    adam = {n: optimizer.state[p]["exp_avg"].clone() for n, p in named.items() if p in optimizer.state}
    return {n: p.detach().clone() for n, p in named.items()}, adam


def test_fp32_and_one_process_o2_checkpoints_load_into_each_other(lean_cfg, tmp_path):
    cfg = lean_cfg(*FINETUNE)
    source, batches = micro_batches(cfg, 1, 4)
    for writer, reader in ((Precision(), O2), (O2, Precision())):
        path = tmp_path / f"{writer.master_weights}"
        engine, optimizer = _trained(cfg, source, batches, writer)
        dcp.save(path, engine.checkpoint_parameters(), optimizer)
        weights, adam = _state(engine, optimizer)

        fresh = make_engine(cfg, source, reader)
        fresh_opt = build_optimizer(fresh.named_trainable_parameters(), cfg.model.optim)
        dcp.load(path, fresh.checkpoint_parameters(), fresh_opt)
        if fresh.master is not None:
            fresh.master.publish()
        got, got_adam = _state(fresh, fresh_opt)
        assert got_adam.keys() == adam.keys() and adam
        for name, value in adam.items():
            assert torch.equal(got_adam[name], value), name
        model = dict(fresh.checkpoint_parameters())
        for name, value in weights.items():
            # Trained parameters round-trip in fp32 (masters on the O2 side); frozen ones carry the writer's values.
            assert torch.equal(got[name], value.to(model[name].dtype)), name
        if fresh.master is not None:  # the bf16 model follows the loaded masters
            for p, (_, m) in zip(fresh.master.model_params, fresh.master.named_master):
                assert torch.equal(p, m.to(torch.bfloat16))
