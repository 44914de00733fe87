"""Gemma 3 (the tiny gemma3 family: sliding / global layers with their own RoPE bases, four norms per block, scaled
embeddings, bidirectional attention inside each image from the collator's image positions, the gemma3 projector) on
LLaVA-format data with images, two-image and text-only samples: TP2+SP (the post-attention / post-feed-forward norms
on sequence shards), PP2 (the image positions reach the second stage's attention plan) and DP2 ZeRO-3 from packed
rows each equal one process per step on packed rows; DP2 ZeRO-3 reads the same data unpacked (right-padded rows,
causal attention plus the image blocks), so packed = unpacked is checked in the same spawn."""

from __future__ import annotations

import pytest

from .harness import FAMILIES, make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set
from .test_parallel_training import _check_layouts

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "dp2_zero3": ["model.data_parallel=fsdp", "model.zero_stage=3"],  # on unpacked rows
}


def test_gemma3_layouts_and_packing_match_one_process(tmp_path):
    write_llava_set(tmp_path / "llava")
    ckpt = make_checkpoint(tmp_path / "ckpt", "gemma3")
    base = [f"model.restore_from_path={ckpt}", *FAMILIES["gemma3"]]
    packed = base + llava_overrides(tmp_path / "llava", True)
    unpacked = base + llava_overrides(tmp_path / "llava", False)
    ref = train_losses(packed, 2)
    jobs = [(name, (unpacked if name == "dp2_zero3" else packed) + o, 2) for name, o in LAYOUTS.items()]
    results = run_layouts(2, jobs, tmp_path / "layouts")
    _check_layouts(results, LAYOUTS, ref)
