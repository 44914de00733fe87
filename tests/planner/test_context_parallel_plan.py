"""The planner knows context parallelism: a rank's activations, compute and parameter shards divide by cp, its
attention keeps the whole rows' gathered keys and values, and the all-gathers cost time."""

from __future__ import annotations

import pytest

from neva.config import compose_config
from neva.planner.plan import plan_run
from neva.planner.report import format_table
from neva.planner.search import search

LONG = [
    "+stage=finetune",
    "cluster=dgx_h100",
    "trainer.precision=bf16-mixed",
    "model.mm_cfg.llm.preset=llama2_7b",
    "model.micro_batch_size=1",
    "model.global_batch_size=8",
    "trainer.devices=8",
]
TOKENS = 32768


def _plan(monkeypatch, cp: int):
    monkeypatch.setenv("WORLD_SIZE", "8")
    return plan_run(compose_config([*LONG, f"model.context_parallel_size={cp}"]), text_tokens=TOKENS)


def test_cp_divides_a_ranks_share_and_adds_the_gathered_keys_and_values(monkeypatch):
    one, cp4 = _plan(monkeypatch, 1), _plan(monkeypatch, 4)
    assert (one.deployment.layout.dp, cp4.deployment.layout.dp, cp4.deployment.layout.cp) == (8, 2, 4)
    # Parameters, gradients and optimizer state: FSDP2 shards over dp × cp (8 ranks either way).
    assert cp4.peak.params == one.peak.params and cp4.peak.optimizer == one.peak.optimizer
    # Activations: a quarter of the tokens per rank, plus each layer's gathered keys and values (3 more quarters of
    # the rows' K and V: 2 · 3/4 · S · kv_heads · head_dim · 2 bytes per layer).
    kv_extra = 32 * 2 * 0.75 * TOKENS * 32 * 128 * 2
    assert cp4.peak.activations == pytest.approx(one.peak.activations / 4 + kv_extra, rel=0.02)
    assert cp4.peak.activations < one.peak.activations / 3
    # Compute per micro-batch divides by cp, and each rank runs cp times the micro-batches (dp is a quarter): the same
    # compute per step; the key/value all-gathers add communication time.
    assert cp4.deployment.layout.grad_accum == 4 * one.deployment.layout.grad_accum
    assert cp4.time.compute == pytest.approx(one.time.compute, rel=1e-6)
    assert one.time.cp_comm == 0 < cp4.time.cp_comm


def test_search_varies_context_parallelism_when_asked(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = compose_config([*LONG, "cluster.gpu_memory_gb=1000"])
    fixed = {"tensor_model_parallel_size": [1], "pipeline_model_parallel_size": [1], "sequence_parallel": [False],
             "data_parallel": ["fsdp"], "zero_stage": [3], "activations_checkpoint_granularity": ["full"],
             "micro_batch_size": [1]}  # fmt: skip
    result = search(cfg, {**fixed, "context_parallel_size": [1, 2, 4]}, top=0, text_tokens=TOKENS)
    assert sorted(p.deployment.layout.cp for p in result.plans) == [1, 2, 4]
    by_cp = {p.deployment.layout.cp: p for p in result.plans}
    dp_column = [line.split()[3] for line in format_table([by_cp[1], by_cp[4]]).splitlines()]
    assert dp_column == ["dp", "8", "2+cp4"]
    assert by_cp[4].peak.activations < by_cp[2].peak.activations < by_cp[1].peak.activations
