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


def test_all_to_all_time_in_the_step_model(monkeypatch):
    from neva.planner.hardware import hardware_from_config

    one = _plan(monkeypatch, 8, "model.expert_model_parallel_size=1")
    ep8 = _plan(monkeypatch, 8, "model.expert_model_parallel_size=8")
    assert one.time.ep_comm == 0.0
    hw = hardware_from_config(compose_config([*MIXTRAL, "trainer.devices=8"]).cluster)
    # per micro-batch and MoE layer: dispatch + combine forward, both again in backward (the LLM trains); bf16
    # autocast moves fp32 hidden states (4 bytes) of k = 2 rows per token; an 8-GPU expert group: NVLink
    routed = 4 * 1 * ep8.seq_len * 4096 * 2
    per_call = 7 / 8 * routed / (hw.nvlink_bytes_per_s * hw.eff.nvlink) + hw.eff.latency_us * 1e-6
    assert ep8.time.ep_comm == pytest.approx(32 * 4 * per_call)
    t = ep8.time  # on the step's critical path (one stage: no bubble)
    assert t.step - t.jitter - t.optimizer - t.dp_exposed == pytest.approx(t.compute + t.tp_comm + t.ep_comm)


def test_search_varies_expert_parallelism_over_divisors_of_the_experts(monkeypatch):
    from neva.planner.report import format_table
    from neva.planner.search import search

    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = compose_config([*MIXTRAL, "model.global_batch_size=8", "trainer.devices=8", "cluster.gpu_memory_gb=1000"])
    fixed = {
        "tensor_model_parallel_size": [1], "pipeline_model_parallel_size": [1], "data_parallel": ["fsdp"],
        "zero_stage": [3], "activations_checkpoint_granularity": ["full"], "micro_batch_size": [1],
    }  # fmt: skip
    result = search(cfg, fixed, top=0)
    assert sorted(p.deployment.layout.ep for p in result.plans) == [1, 2, 4, 8]  # every power of two dividing 8
    assert "ep" in format_table(result.plans).splitlines()[0].split()


def test_context_parallel_draws_expert_groups_from_dp_and_cp(monkeypatch):
    """CP4 × EP8 on 8 GPUs (dp 2): training draws expert groups from dp × cp (``neva.parallel.mesh``), so the plan
    and the search accept EP up to 8; each rank routes its quarter of every row, over four micro-batches a step."""
    from neva.planner.hardware import hardware_from_config
    from neva.planner.search import search

    both = _plan(monkeypatch, 8, "model.expert_model_parallel_size=8", "model.context_parallel_size=4")
    lay = both.deployment.layout
    assert (lay.dp, lay.cp, lay.ep, lay.grad_accum) == (2, 4, 8, 4)
    moe = both.extra["moe"]
    experts = 32 * 3 * 8 * 4096 * 14336
    assert moe["expert_params_per_rank"] == experts // 8  # one expert per rank, whole
    # EP2: four experts per rank, FSDP2-sharded over the dp × cp / ep = 4 replicas of the expert group
    ep2 = _plan(monkeypatch, 8, "model.expert_model_parallel_size=2", "model.context_parallel_size=4").extra["moe"]
    assert ep2["expert_params_per_rank"] == experts // 8
    tokens = both.seq_len / 4 * 4  # a quarter of each row, four micro-batches
    assert moe["all_to_all_bytes_per_step"] == pytest.approx(4 * 2 * 4096 * tokens * 32 * 4 * 7 / 8)
    hw = hardware_from_config(compose_config([*MIXTRAL, "trainer.devices=8"]).cluster)
    routed = 4 * 1 * both.seq_len / 4 * 4096 * 2  # fp32 rows, k = 2, a quarter of the row per micro-batch
    per_call = 7 / 8 * routed / (hw.nvlink_bytes_per_s * hw.eff.nvlink) + hw.eff.latency_us * 1e-6
    assert both.time.ep_comm == pytest.approx(4 * 32 * 4 * per_call)

    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = compose_config([*MIXTRAL, "model.global_batch_size=8", "trainer.devices=8", "cluster.gpu_memory_gb=1000"])
    fixed = {
        "tensor_model_parallel_size": [1], "pipeline_model_parallel_size": [1], "data_parallel": ["fsdp"],
        "zero_stage": [3], "activations_checkpoint_granularity": ["full"], "micro_batch_size": [1],
        "context_parallel_size": [4],
    }  # fmt: skip
    result = search(cfg, fixed, top=0)
    assert sorted(p.deployment.layout.ep for p in result.plans) == [1, 2, 4, 8]  # every divisor of dp × cp = 8
