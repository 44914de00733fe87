"""Native resolution (Qwen2.5-VL's tower and merger, M-RoPE decoder) on LLaVA-format data — images of five sizes
(each its own patch grid), text-only and two-image samples, packed rows — under TP2+SP (the merger sharded), PP2
(tower and merger on stage 0, three position axes through the stages) and DP2 ZeRO-3: each equals one process per
step."""

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


def test_native_resolution_layouts_match_one_process(tmp_path):
    llava_dir = tmp_path / "llava"
    write_llava_set(llava_dir)
    family = "qwen2_5_vl_native"
    ckpt = make_checkpoint(tmp_path / "ckpt", family)
    data = [f"model.restore_from_path={ckpt}", *FAMILIES[family], *llava_overrides(llava_dir, True)]
    data.append("model.data.conv_template=chatml")
    ref = train_losses(data, 2)
    results = run_layouts(2, [(n, data + o, 2) for n, o in LAYOUTS.items()], tmp_path / "layouts")
    _check_layouts(results, LAYOUTS, ref)
