"""Layout search: only layouts training accepts and the planner's own memory model says fit, fastest first, and the
layouts one expects for known cases."""

from __future__ import annotations

import dataclasses
import json

from neva.config import compose_config
from neva.plan import main, parse_args, split_constraints
from neva.planner.plan import plan_run
from neva.planner.search import search

O2 = ["trainer.precision=bf16", "model.megatron_amp_O2=true"]


def _replan(cfg, plan):
    """The plan of ``plan``'s layout, computed on its own by ``plan_run`` (the independent check of the search)."""
    lay = plan.deployment.layout
    model = dataclasses.replace(
        cfg.model,
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        sequence_parallel=lay.sp,
        data_parallel=lay.data_parallel,
        zero_stage=lay.zero_stage,
        context_parallel_size=lay.cp,
        activations_checkpoint_granularity=lay.ac,
        micro_batch_size=lay.micro_batch_size,
    )
    return plan_run(dataclasses.replace(cfg, model=model))


def test_search_returns_fitting_layouts_fastest_first() -> None:
    # The tiny model on 4 GPUs whose memory is cut to 75 MiB (50 of them overhead) so that only some layouts fit.
    cfg = compose_config(
        [
            "+stage=finetune",
            "cluster=dgx_h100",
            "trainer.devices=4",
            "cluster.gpu_memory_gb=0.075",
            "cluster.efficiency.memory_overhead_gb=0.05",
            *O2,
        ]
    )
    everything = search(cfg, top=0)
    assert 0 < everything.fitting < everything.valid < everything.tried
    speeds = [p.samples_per_s for p in everything.plans]
    assert speeds == sorted(speeds, reverse=True)
    for plan in everything.plans:
        again = _replan(cfg, plan)
        assert again.fits and again.peak.total == plan.peak.total and again.samples_per_s == plan.samples_per_s
        lay = plan.deployment.layout
        assert lay.world == 4 and lay.global_batch_size == cfg.model.global_batch_size
        if lay.pp > 1:
            assert lay.grad_accum >= lay.pp  # 1F1B needs a micro-batch per stage: training refuses fewer
    top = search(cfg, top=3)
    assert [p.samples_per_s for p in top.plans] == speeds[:3]


def test_small_model_prefers_plain_data_parallel() -> None:
    """No memory pressure: TP, PP and recomputation only add communication, bubbles and FLOPs."""
    cfg = compose_config(["+stage=finetune", "cluster=dgx_h100", "trainer.devices=8", *O2])
    best = search(cfg, top=1).plans[0].deployment.layout
    assert (best.tp, best.pp, best.ac) == (1, 1, None)


def test_13b_finetune_on_one_h100_node_needs_sharding() -> None:
    """13B finetune, bf16 O2, 8 × 80 GB: replicated training state (13B × 18 bytes) cannot fit one GPU, so TP 1 with
    DDP never appears; NVIDIA's layout (TP 8, no checkpointing, micro-batch 4) fits and beats its own recomputing
    variant."""
    cfg = compose_config(["+preset=nemo_llama2_13b_finetune"])
    found = search(
        cfg,
        {
            "tensor_model_parallel_size": [1, 8],
            "pipeline_model_parallel_size": [1],
            "sequence_parallel": [False],
            "activations_checkpoint_granularity": [None, "full"],
            "micro_batch_size": [4],
        },
        top=0,
    )
    layouts = [p.deployment.layout for p in found.plans]
    assert not any(lay.tp == 1 and lay.data_parallel == "ddp" for lay in layouts)
    nvidia = [lay for lay in layouts if lay.tp == 8 and lay.ac is None]
    assert nvidia
    recomputing = [p for p in found.plans if p.deployment.layout.tp == 8 and p.deployment.layout.ac == "full"]
    fastest_nvidia = next(p for p in found.plans if p.deployment.layout in nvidia)
    assert all(fastest_nvidia.samples_per_s > p.samples_per_s for p in recomputing)


def test_cli_search_honours_command_line_constraints(capsys) -> None:
    plans = main(["cluster=dgx_a100", "trainer.devices=4", "model.tensor_model_parallel_size=2", "plan.search=3"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("# the configured nodes:")
    assert len(plans) == 3 and all(p.deployment.layout.tp == 2 for p in plans)
    assert [r["layout"]["tp"] for r in json.loads(out[-1])] == [2, 2, 2]
    req, constraints = split_constraints(parse_args(["model.micro_batch_size=2,4", "+preset=nemo_llama2_7b_pretrain"]))
    assert constraints == {"micro_batch_size": [2, 4]} and req.sweeps == []
    assert req.fixed == ["+preset=nemo_llama2_7b_pretrain"]  # a preset selects the stage: none is added
    assert main(["--help"]) == [] and "plan.search" in capsys.readouterr().out


def test_tied_embeddings_are_never_proposed_with_pipeline_stages() -> None:
    """Qwen2's tied embeddings (one tensor for the first and the last stage): training refuses PP for them, so the
    search never offers a PP layout, and the biased, tied model is planned for the others."""
    cfg = compose_config(["+stage=finetune", "model=tiny_qwen2", "cluster=dgx_h100", "trainer.devices=8", *O2])
    result = search(cfg, top=0)
    layouts = [p.deployment.layout for p in result.plans]
    assert layouts and all(lay.pp == 1 for lay in layouts)
    assert any(lay.tp > 1 for lay in layouts)


def test_layouts_training_refuses_under_tensor_parallelism_are_never_proposed() -> None:
    """LoRA and a trained vision tower are refused under TP at start (``check_tensor_parallel``, one of
    ``check_run``'s rules); ``plan_run`` asks the same rules, so neither the search nor the start-of-run line built on
    it proposes such a layout (``plan_run`` of one refuses it with training's message:
    ``tests/parallel/test_run_rules.py``)."""
    base = ["+stage=finetune", "cluster=dgx_h100", "trainer.devices=8", *O2]
    for extra in (["model.peft.peft_scheme=lora"], ["model.mm_cfg.vision_encoder.freeze=false"]):
        result = search(compose_config(base + extra), top=0)
        assert result.plans and all(p.deployment.layout.tp == 1 for p in result.plans), extra
    assert any(p.deployment.layout.tp > 1 for p in search(compose_config(base), top=0).plans)
