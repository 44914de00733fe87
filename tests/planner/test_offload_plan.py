"""The planner learns the offload knobs (``neva.planner.offload``): FSDP2's CPU offload moves the sharded state to the
host (the bytes the rehearsal measures there, exactly, on the tiny model), activation offload the saved activations
but one block's; their bus traffic and the host's AdamW enter the step; the search turns them on only when nothing
fits without them, and the start-of-run forecast names the device memory each saves."""

from __future__ import annotations

import dataclasses

import pytest

from neva.config import compose_config
from neva.planner.forecast import forecast_line
from neva.planner.memory import rank_state_bytes
from neva.planner.params import model_inventory, stage_layers
from neva.planner.plan import plan_run
from neva.planner.search import search

TINY_O2 = ["+stage=finetune", "trainer.precision=bf16", "model.megatron_amp_O2=true", "model.micro_batch_size=1",
           "cluster=dgx_a100", "trainer.devices=1", "model.global_batch_size=2"]  # fmt: skip
# 7B finetune, bf16 O2, one 80 GB GPU: the state alone (16 bytes a parameter) is over the device's memory
SEVEN_B = ["model=llama2_7b", "vision=clip_vit_l14_336", "+stage=finetune", "cluster=dgx_h100", "trainer.devices=1",
           "trainer.precision=bf16", "model.megatron_amp_O2=true", "model.global_batch_size=16"]  # fmt: skip


def test_fsdp_offload_moves_the_sharded_state_to_the_host():
    cfg = compose_config(TINY_O2 + ["model.fsdp_offload=true"])
    plan = plan_run(cfg, text_tokens=16)
    stage = plan.stages[0]
    assert (stage.params, stage.optimizer) == (0, 0)
    # the host holds exactly what the rank holds at rest under FSDP2 (fp32 shards, their gradients, AdamW)
    from neva.checkpoint.architecture import neva_config_from_mm

    ncfg = neva_config_from_mm(cfg.model.mm_cfg)
    infos = model_inventory(ncfg, cfg.model.trainable_policy())
    state = rank_state_bytes(infos, plan.deployment, 0, stage_layers(ncfg.llm.num_layers, plan.deployment.layout))
    assert stage.host == state.params + state.grads + state.optimizer
    assert plan.time.offload > 0 and plan.time.optimizer > 0  # the shards' copies; AdamW on the host


def test_rehearsed_host_bytes_equal_the_planned_ones():
    from neva.checkpoint.architecture import neva_config_from_mm
    from neva.parallel.layout import Layout
    from neva.training.rehearsal import rehearse, shallow

    cfg = compose_config(TINY_O2 + ["model.fsdp_offload=true"])
    model = shallow(neva_config_from_mm(cfg.model.mm_cfg), Layout.from_config(cfg.model, 1))  # one decoder layer
    (measured,) = rehearse(cfg, text_tokens=16, model=model)
    planned = plan_run(cfg, text_tokens=16, model=model).stages[0]
    assert measured.host == planned.host
    assert measured.categories["params"] == measured.categories["optimizer"] == 0  # on the host, not the device


def test_activation_offload_keeps_one_block_on_the_device():
    base = compose_config(SEVEN_B + ["model.micro_batch_size=4", "model.fsdp_offload=true"])
    plain = plan_run(base)
    off = plan_run(dataclasses.replace(base, model=dataclasses.replace(base.model, activation_offload=True)))
    a, b = plain.stages[0], off.stages[0]
    layers = 32
    # what the blocks save moves to the host but one block's worth; nothing is lost or counted twice
    assert b.activations + (b.host - a.host) == pytest.approx(a.activations)
    assert b.host - a.host == pytest.approx((a.activations - b.activations), rel=1e-9)
    assert b.activations < a.activations * (1 - (layers - 2) / layers / 2)
    assert off.time.offload > plain.time.offload


def test_search_and_forecast_propose_offload_when_nothing_fits():
    cfg = compose_config(SEVEN_B + ["model.micro_batch_size=4", "model.activations_checkpoint_granularity=full"])
    assert not plan_run(cfg).fits
    found = search(cfg, constraints={"micro_batch_size": [1, 4]}, top=1)
    assert found.offload == ("fsdp_offload",) and found.plans[0].fits
    assert found.plans[0].deployment.layout.fsdp_offload
    line = forecast_line(cfg)
    assert "does NOT fit" in line and "model.fsdp_offload=true saves" in line, line
    saved = float(line.split("model.fsdp_offload=true saves ")[1].split(" GiB")[0])
    fitted = plan_run(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fsdp_offload=True)))
    assert saved == pytest.approx((plan_run(cfg).peak.total - fitted.peak.total) / 2**30, abs=0.05)


def test_a_token_budget_plans_the_micro_batches_it_fills():
    """``model.data.max_tokens_per_micro_batch``: the planned micro-batch holds as many planned samples as the budget
    fits (the global batch kept), so a budget of two samples' tokens plans what ``micro_batch_size=2`` plans."""
    base = compose_config(SEVEN_B + ["model.micro_batch_size=8", "model.fsdp_offload=true"])
    seq = plan_run(base).seq_len
    budget = plan_run(compose_config(SEVEN_B + ["model.micro_batch_size=8", "model.fsdp_offload=true",
                                                f"model.data.max_tokens_per_micro_batch={2 * seq + 1}"]))  # fmt: skip
    two = plan_run(compose_config(SEVEN_B + ["model.micro_batch_size=2", "model.fsdp_offload=true"]))
    assert budget.deployment.layout.micro_batch_size == 2
    assert budget.peak.total == pytest.approx(two.peak.total) and budget.time.step == pytest.approx(two.time.step)
