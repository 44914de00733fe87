"""GLM-4.1V (the tiny tower with interpolated learned positions, its downsampling SwiGLU merger, the GLM-4 decoder
with four norms per layer and M-RoPE over half of each head) on LLaVA-format data — images of five sizes, each its
own patch grid, text-only and two-image samples, packed rows — under TP2+SP, PP2 (tower and merger on stage 0, three
position axes through the stages), DP2 ZeRO-3, CP2 and DDP2 with full
activation checkpointing: each equals one process per step."""

from __future__ import annotations

import pytest

from .harness import FAMILIES, make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set
from .test_native_layouts import LAYOUTS
from .test_parallel_training import _check_layouts

pytestmark = pytest.mark.slow

FAMILY = "glm4v_native"
# and CP2 (the sequence split with three M-RoPE position axes, the images' features placed on each chunk), and DDP
# with the blocks recomputed in the backward (full activation checkpointing)
CP2 = {
    **LAYOUTS,
    "cp2": ["model.context_parallel_size=2"],
    "ddp2_recompute": ["model.data_parallel=ddp", "model.activations_checkpoint_granularity=full"],
}


def test_glm4v_layouts_match_one_process(tmp_path):
    llava_dir = tmp_path / "llava"
    write_llava_set(llava_dir)
    ckpt = make_checkpoint(tmp_path / "ckpt", FAMILY)
    data = [f"model.restore_from_path={ckpt}", *FAMILIES[FAMILY], *llava_overrides(llava_dir, True)]
    data.append("model.data.conv_template=chatml")
    ref = train_losses(data, 2)
    results = run_layouts(2, [(name, data + o, 2) for name, o in CP2.items()], tmp_path / "layouts")
    _check_layouts(results, CP2, ref)
