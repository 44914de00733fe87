"""The planner's MoE facts: Mixtral-8x7B's published parameter counts (46.7B total, 12.9B active per token,
mistral.ai's announcement), experts per rank under expert parallelism, the all-to-all volume."""

from __future__ import annotations

import pytest

from neva.config import compose_config
from neva.planner.plan import plan_run

MIXTRAL = [
    "+stage=finetune",
    "cluster=dgx_h100",
    "trainer.precision=bf16-mixed",
    "model.mm_cfg.llm.preset=mixtral_8x7b",
    "model.micro_batch_size=1",
]


def _plan(monkeypatch, world: int, *overrides: str):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = compose_config([*MIXTRAL, "model.global_batch_size=8", "trainer.devices=8", *overrides])
    return plan_run(cfg)


def test_mixtral_total_and_active_parameters_and_experts_per_rank(monkeypatch):
    one = _plan(monkeypatch, 8, "model.expert_model_parallel_size=1")
    moe = one.extra["moe"]
    # the tiny vision tower and projector add well under 0.1B
    assert moe["total_params"] / 1e9 == pytest.approx(46.7, abs=0.1)
    assert moe["active_params"] / 1e9 == pytest.approx(12.9, abs=0.1)
    assert moe["all_to_all_bytes_per_step"] == 0  # no expert parallelism: nothing leaves the rank
    ep8 = _plan(monkeypatch, 8, "model.expert_model_parallel_size=8").extra["moe"]
    ep2 = _plan(monkeypatch, 8, "model.expert_model_parallel_size=2").extra["moe"]
    experts = 32 * 3 * 8 * 4096 * 14336
    # FSDP2 shards everything over dp = 8 without EP; under EP8 each rank holds its one expert whole, under EP2 its
    # four experts sharded over the group's four replicas: the same bytes at rest, different gathers in compute.
    assert moe["expert_params_per_rank"] == experts // 8
    assert ep8["expert_params_per_rank"] == experts // 8 == ep2["expert_params_per_rank"]
    tokens = one.seq_len * 1 * 1  # micro-batch 1, one micro-batch per rank and step
    # 4 k H elements per token and MoE layer, fp32 under autocast (the norm's output), 7/8 of it to other ranks
    assert ep8["all_to_all_bytes_per_step"] == pytest.approx(4 * 2 * 4096 * tokens * 32 * 4 * 7 / 8)
