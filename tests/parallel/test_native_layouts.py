"""Native resolution (Qwen2.5-VL's tower and merger, M-RoPE decoder) on LLaVA-format data — images of five sizes
(each its own patch grid), text-only and two-image samples, packed rows — under TP2+SP (the merger sharded), PP2
(tower and merger on stage 0, three position axes through the stages) and DP2 ZeRO-3: each equals one process per
step; DP2 logs the most and the mean tower patches per rank (their mean × 2 = the one process's patches).
Qwen3-VL's DeepStack (features added to decoder layers 0 and 1: sequence-split under SP, on PP's first stage) the
same in the same spawn, and Qwen3-VL-MoE under EP2. Qwen3.5's hybrid decoder (Gated DeltaNet layers: heads sharded
under TP, the packed samples' states restarting in every layout) under TP2+SP, PP2 (the linear layers on stage 0,
the attention layer on stage 1), DP2 ZeRO-3 and CP2 (state and convolution inputs passed chunk to chunk), and Qwen3.5-MoE (a gated shared expert beside the routed ones)
under EP2."""

from __future__ import annotations

import pytest

from .harness import FAMILIES, make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set
from .test_parallel_training import _check_layouts

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "dp2_zero3": ["model.data_parallel=fsdp", "model.zero_stage=3"],
}
EP2 = {"ep2": ["model.expert_model_parallel_size=2"]}
# Qwen3.5's linear-attention layers under CP2 too: the convolution's inputs and the state passed chunk to chunk
HYBRID = {**LAYOUTS, "cp2": ["model.context_parallel_size=2"]}


def test_native_resolution_layouts_match_one_process(tmp_path):
    llava_dir = tmp_path / "llava"
    write_llava_set(llava_dir)
    runs, refs = [], {}
    layouts = {
        "qwen2_5_vl_native": LAYOUTS,
        "qwen3_vl_native": LAYOUTS,
        "qwen3_vl_moe_native": EP2,
        "qwen3_5_native": HYBRID,
        "qwen3_5_moe_native": EP2,
    }
    for family in layouts:
        ckpt = make_checkpoint(tmp_path / f"ckpt_{family}", family)
        data = [f"model.restore_from_path={ckpt}", *FAMILIES[family], *llava_overrides(llava_dir, True)]
        data.append("model.data.conv_template=chatml")
        refs[family] = train_losses(data, 2)
        runs += [(f"{family}:{n}", data + o, 2) for n, o in layouts[family].items()]
    # one spawn for every family's layouts
    results = run_layouts(2, runs, tmp_path / "layouts")
    for family, ref in refs.items():
        ranks = [{n.split(":", 1)[1]: r for n, r in rank.items() if n.startswith(family + ":")} for rank in results]
        _check_layouts(ranks, layouts[family], ref)
    ref = refs["qwen2_5_vl_native"]
    dp2_rows = [rank["qwen2_5_vl_native:dp2_zero3"]["tower_patches"] for rank in results]
    for dp2 in dp2_rows:  # the same row on both ranks (one all-reduce), the step's patches shared between them
        assert dp2 == dp2_rows[0]
        for step, one in zip(dp2, ref["tower_patches"], strict=True):
            assert step["tower_patches_mean"] * 2 == one["tower_patches_max"] > 0
            assert step["tower_patches_mean"] <= step["tower_patches_max"] <= one["tower_patches_max"]
