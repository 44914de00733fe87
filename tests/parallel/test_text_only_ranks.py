"""A trainable vision tower with a text-only micro-batch on one rank and images on the other (the most reported VLM
trainer failure: the rank without images skipped the tower, and DDP's buckets / FSDP's reduce-scatters no longer
matched). Every rank runs the same modules on every micro-batch (``neva.models.media``): each layout equals one
process step by step, and none hangs (a mismatch would end at the collective timeout, failing the spawn).

One spawn of two gloo processes: DDP, FSDP2 ZeRO-2 and ZeRO-3, PP2 (the tower on stage 0, text-only micro-batches
through the schedule) and EP2 (an MoE decoder: the tower's gradients reduced over the expert-parallel ranks)."""

from __future__ import annotations

import pytest

from .harness import make_checkpoint, run_layouts, train_losses
from .test_parallel_training import _check_layouts

pytestmark = pytest.mark.slow

STEPS = 2  # rank 0 text only at step 0, rank 1 at step 1
TRAINABLE = [
    "model.mm_cfg.vision_encoder.freeze=false",
    "model.global_batch_size=4",  # one micro-batch of two rows per DP rank and step
]
MOE = "++model.mm_cfg.llm.arch_overrides={num_layers:2,num_moe_experts:4,moe_aux_loss_coeff:0.1}"
LAYOUTS = {
    "dp2_ddp": ["model.data_parallel=ddp"],
    "dp2_zero2": ["model.data_parallel=fsdp", "model.zero_stage=2"],
    "dp2_zero3": ["model.data_parallel=fsdp", "model.zero_stage=3"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
}
MOE_LAYOUTS = {"ep2": ["model.expert_model_parallel_size=2"]}


def test_trainable_tower_with_a_text_only_rank_matches_one_process(tmp_path):
    dense = [f"model.restore_from_path={make_checkpoint(tmp_path / 'dense')}", *TRAINABLE]
    moe_ckpt = make_checkpoint(tmp_path / "moe", base=None, extra=[MOE])
    moe = [f"model.restore_from_path={moe_ckpt}", MOE, *TRAINABLE]
    kinds = dict(steps=STEPS, kinds="text_only_alternating")
    refs = {"dense": train_losses(dense, **kinds), "moe": train_losses(moe, **kinds)}
    # the tower really trains: a text-only micro-batch leaves its gradient zero, an image one does not
    assert refs["dense"]["grad_norms"][0] > 0
    jobs = [(n, dense + o, kinds) for n, o in LAYOUTS.items()] + [(n, moe + o, kinds) for n, o in MOE_LAYOUTS.items()]
    results = run_layouts(2, jobs, tmp_path / "layouts")
    _check_layouts(results, LAYOUTS, refs["dense"])
    _check_layouts(results, MOE_LAYOUTS, refs["moe"])
