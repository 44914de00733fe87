"""The planner knows context parallelism: a rank's activations, compute and parameter shards divide by cp, its
attention keeps the whole rows' gathered keys and values, and the all-gathers cost time."""

from __future__ import annotations

import dataclasses

import pytest

from neva.config import compose_config
from neva.planner.plan import plan_run
from neva.planner.report import format_table
from neva.planner.search import LONG_ROW, context_parallel_sizes, search
from neva.typed import ConfigError

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


def test_search_widens_context_parallelism_for_long_rows_and_layouts_that_do_not_fit(monkeypatch):
    """The rule (``context_parallel_sizes``): the configured size alone when the configured layout fits a short row;
    1, 2, 4 and 8 where they divide the world when the row is ``LONG_ROW`` positions or more, or nothing fits."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = compose_config([*LONG, "model.global_batch_size=24"])
    short = plan_run(cfg)
    assert short.fits and short.seq_len < LONG_ROW
    assert context_parallel_sizes(cfg, short) == [1]
    assert context_parallel_sizes(cfg, plan_run(cfg, text_tokens=LONG_ROW)) == [1, 2, 4, 8]
    assert context_parallel_sizes(cfg, None) == [1, 2, 4, 8]  # a configured layout training refuses
    small = compose_config([*LONG, "cluster.gpu_memory_gb=10"])
    assert not plan_run(small).fits and context_parallel_sizes(small, plan_run(small)) == [1, 2, 4, 8]
    twelve = compose_config([*LONG, "trainer.devices=12", "model.global_batch_size=12"])
    assert context_parallel_sizes(twelve, None) == [1, 2, 4]  # 8 does not divide 12 GPUs


def test_long_video_preset_search_shows_which_context_parallel_size_fits():
    """LLaVA-Video 7B, 64 frames (11328 positions), the script's ZeRO-3 with full recomputation on 128 H100s: one
    process per row needs more than 80 GiB (the trained tower's 64 frames, the row's activations); the search, not
    told to, tries CP 2, 4 and 8, and each fits, a little slower the larger it is (the key/value all-gathers)."""
    cfg = compose_config(["+preset=llava_video_qwen2_7b"])
    fixed = {"tensor_model_parallel_size": [1], "pipeline_model_parallel_size": [1], "sequence_parallel": [False],
             "data_parallel": ["fsdp"], "zero_stage": [3], "activations_checkpoint_granularity": ["full"],
             "micro_batch_size": [1]}  # fmt: skip
    result = search(cfg, fixed, top=0, num_frames=64)
    by_cp = {p.deployment.layout.cp: p for p in result.plans}
    assert result.valid == 4 and sorted(by_cp) == [2, 4, 8]  # CP 1 was planned and does not fit
    one = plan_run(dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, context_parallel_size=1, zero_stage=3, activations_checkpoint_granularity="full")), num_frames=64)  # fmt: skip
    assert one.seq_len == 64 * 169 + 512 and not one.fits and one.peak.total > 80 * 2**30
    steps = [by_cp[cp].time.step for cp in (2, 4, 8)]
    assert steps == sorted(steps) and 0 < by_cp[2].time.cp_comm < by_cp[8].time.cp_comm
    assert [by_cp[cp].peak.activations for cp in (2, 4, 8)] == sorted((p.peak.activations for p in by_cp.values()),
                                                                      reverse=True)  # fmt: skip


def test_the_planner_refuses_what_context_parallelism_does_not_compose_with(monkeypatch):
    """A layout search never proposes CP where training refuses it: PP with LLaVA's micro-batch mean (the engine's
    check, ``neva.parallel.context_parallel``); the preference objective and a native-resolution tower, which train
    under CP, are planned."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    refused = ["+preset=llava15_llama2_7b_finetune", "model.context_parallel_size=2",
               "model.pipeline_model_parallel_size=2"]  # fmt: skip
    with pytest.raises(ConfigError, match="micro_batch_mean"):
        plan_run(compose_config(refused))
    for preset in ("llava_next_dpo_qwen2_7b", "qwen_vl_finetune_qwen2_5_vl_7b"):
        plan = plan_run(compose_config([f"+preset={preset}", "model.context_parallel_size=2"]))
        assert plan.deployment.layout.cp == 2, preset
