"""The online RL stage under DP2 (FSDP2 ZeRO-3), TP2, TP2 with sequence parallelism, PP2 and CP2 equals one process:
the same completions from the same seeds (sampled rollouts on the sharded training model, and greedy ones of the
first step's prompts), and the μ = 2 updates' losses and gradient norms (KL to a frozen reference, recorded old
log-probs) within 1e-5. One spawn of two gloo processes."""

from __future__ import annotations

import pytest

from .harness import BASE, make_checkpoint, run_layouts

pytestmark = pytest.mark.slow

RTOL = 1e-5
DROPPED = ("+stage=finetune", "model.optim.sched.warmup_steps=1", "model.micro_batch_size=2",
           "model.global_batch_size=8")  # fmt: skip
GRPO_BASE = [o for o in BASE if o not in DROPPED] + [
    "+stage=grpo", "model.micro_batch_size=2", "model.global_batch_size=4", "model.grpo.num_generations=3",
    "model.grpo.max_new_tokens=4", "model.grpo.beta=0.04", "model.grpo.num_iterations=2", "model.optim.lr=1e-3",
    "model.grpo.temperature=1.5",
    "model.grpo.rewards=[{function: accuracy, weight: 1.0}, {function: 'tests.training.test_grpo_stage:text_length',"
    " weight: 1.0}]",
]  # fmt: skip
LAYOUTS = {
    "zero3": ["model.data_parallel=fsdp", "model.zero_stage=3"],
    "tp2": ["model.tensor_model_parallel_size=2"],
    # every forward (a decoding step's one position, prompts of any length) padded to the sequence-parallel multiple
    "tp2sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "cp2": ["model.context_parallel_size=2"],
}


def grpo_steps(overrides: list[str], steps: int) -> dict:
    """``steps`` rollout steps as ``NevaModule.training_step`` runs them; this rank's completions (record id, ids),
    greedy completions of the first step's prompts, and every update's loss and gradient norm."""
    from dataclasses import replace

    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.module import NevaModule, StepBatches
    from neva.training.optim import build_optimizer, build_scheduler
    from neva.training.rollouts import InRunRollouts
    from neva.training.run import data_module_type

    cfg = compose_config(GRPO_BASE + overrides)
    layout = resolve_layout(cfg)
    source = resolve_source(cfg)
    data = data_module_type(cfg)(
        cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=cfg.model.micro_batch_size,
        dp_rank=layout.dp_rank, dp_world=layout.dp, seed=cfg.model.seed, accumulation=layout.grad_accum,
    )  # fmt: skip
    data.setup("fit")
    module = NevaModule(cfg, source, data, layout)
    module.configure_model()
    optimizer = build_optimizer(module.engine.named_trainable_parameters(), cfg.model.optim)
    scheduler = build_scheduler(optimizer, cfg.model.optim, cfg.trainer.max_steps)
    sampled = module.stage_step.rollouts
    greedy = InRunRollouts(module.engine, replace(sampled.decoding, do_sample=False), sampled.decode)
    rows, updates, greedy_rows = [], [], []
    for i, micro_batches in enumerate(StepBatches(data, layout.grad_accum)):
        if i == steps:
            break
        for mb in micro_batches if i == 0 else ():
            completions = greedy.sample(mb["prompts"], 1, [0] * len(mb["prompts"]))
            greedy_rows += [[str(r.get("id")), ids] for r, ids in zip(mb["records"], completions)]
        module.engine.model.train()
        module.stage_step.run(optimizer, scheduler, micro_batches, i * cfg.model.grpo.num_iterations)
        rows += [[str(k), ids] for k, ids in module.stage_step.last_rows]
        updates += module.stage_step.last_updates
    return {
        "rows": rows,
        "greedy": greedy_rows,
        "losses": [u[0] for u in updates],
        "grad_norms": [u[1] for u in updates],
    }


def test_layouts_roll_out_and_update_as_one_process(tmp_path):
    restore = [f"model.restore_from_path={make_checkpoint(tmp_path / 'ckpt')}"]
    ref = grpo_steps(restore, 1)
    assert len({tuple(ids) for _, ids in ref["rows"]}) > 6  # sampled: the groups' completions differ
    jobs = [(name, restore + o, 1) for name, o in LAYOUTS.items()]
    results = run_layouts(2, jobs, tmp_path / "two", train=grpo_steps)
    assert len({tuple(ids) for _, ids in ref["greedy"]}) > 1
    for name in LAYOUTS:
        for kind in ("rows", "greedy"):
            got = [rank[name][kind] for rank in results]
            if name == "zero3":  # each replica rolls out its own prompts: together the one process's
                assert sorted(got[0] + got[1]) == sorted(ref[kind]), (name, kind)
            else:
                assert got[0] == got[1] == ref[kind], (name, kind)
        for rank in results:
            for key in ("losses", "grad_norms"):
                for a, b in zip(rank[name][key], ref[key], strict=True):
                    assert abs(a - b) <= RTOL * max(abs(b), 1.0), (name, key, rank[name][key], ref[key])
