"""The planner's preference stage (``neva.planner.preference``) against a direct computation: a pair's activations are
those of a micro-batch of twice the sequences; its FLOPs are two sequences' training FLOPs plus, where a reference
runs, two forwards of the whole model (``neva.models.flops`` terms summed directly); a frozen reference copy's bytes
are every parameter of the model in its dtype (none under LoRA or with precomputed log-probs)."""

from __future__ import annotations

import pytest

from neva.checkpoint.architecture import neva_config_from_mm
from neva.config import compose_config
from neva.models.flops import attended_square, flop_terms, model_params
from neva.models.trainable import build_meta_model
from neva.planner.plan import plan_run

BASE = ["cluster=dgx_h100", "trainer.devices=1", "model.micro_batch_size=2", "model.global_batch_size=8"]
DPO = ["+stage=dpo", "model.restore_from_path=/nowhere", *BASE]
LORA = ["model.peft.peft_scheme=lora", "model.mm_cfg.freeze_projector=true"]


def sequence_flops(cfg, seq: int, forward_only: bool) -> float:
    """One sequence's FLOPs (one image), summed over the model's terms: training's, or a frozen model's forward."""
    ncfg = neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)
    policy = cfg.model.trainable_policy()
    terms = flop_terms(model_params(build_meta_model(ncfg, policy)), ncfg)
    units = {"token": seq, "token2": attended_square(seq, ncfg.llm.sliding_window), "image": 1, "frame": 0}
    return sum((t.forward if forward_only else t.total) * units[t.per] for t in terms)


@pytest.mark.parametrize(
    "extra,reference",
    [([], "frozen"), (LORA, "adapters_off"), (["model.dpo.precompute_ref_log_probs=true"], None)],
)
def test_a_pair_is_two_sequences_and_the_reference_is_counted(extra, reference):
    cfg = compose_config(DPO + extra)
    plan = plan_run(cfg)
    # The same model and trained parts as a finetuning run of twice the sequences per micro-batch.
    twice = ["model.micro_batch_size=4", "model.global_batch_size=16"]
    fin_cfg = compose_config(["+stage=finetune", *BASE, *extra, *twice])
    assert fin_cfg.model.trainable_policy() == cfg.model.trainable_policy()
    fin = plan_run(fin_cfg)
    assert plan.seq_len == fin.seq_len
    assert plan.stages[0].activations == fin.stages[0].activations
    assert plan.deployment.layout.micro_batch_size == 2  # reported in pairs

    train = sequence_flops(cfg, plan.seq_len, forward_only=False)
    ref_forward = sequence_flops(cfg, plan.seq_len, forward_only=True) if reference else 0.0
    assert plan.flops_per_sample == pytest.approx(2 * (train + ref_forward), rel=1e-12)

    ncfg = neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)
    numel = sum(p.numel() for p in build_meta_model(ncfg, cfg.model.trainable_policy()).parameters())
    assert plan.stages[0].reference == (4 * numel if reference == "frozen" else 0)  # fp32, one process
    assert plan.peak.total == pytest.approx(fin.peak.total + plan.stages[0].reference)
