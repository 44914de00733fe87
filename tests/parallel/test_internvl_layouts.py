"""InternVL 3 (the tiny InternViT, pixel shuffle projector, Qwen2 decoder) on LLaVA-format data — images of five sizes
tiled into 1 to 13 tower inputs each, text-only and two-image samples — under TP2+SP (the projector sharded, its
LayerNorm replicated), PP2 (tower and projector on stage 0) and DP2 ZeRO-3: each equals one process per step."""

from __future__ import annotations

import pytest

from .harness import FAMILIES, make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set
from .test_native_layouts import LAYOUTS
from .test_parallel_training import _check_layouts

pytestmark = pytest.mark.slow

FAMILY = "internvl_tiles"


def test_internvl_layouts_match_one_process(tmp_path):
    llava_dir = tmp_path / "llava"
    write_llava_set(llava_dir)
    ckpt = make_checkpoint(tmp_path / "ckpt", FAMILY)
    data = [f"model.restore_from_path={ckpt}", *FAMILIES[FAMILY], *llava_overrides(llava_dir, True)]
    data.append("model.data.conv_template=chatml")
    ref = train_losses(data, 2)
    results = run_layouts(2, [(name, data + o, 2) for name, o in LAYOUTS.items()], tmp_path / "layouts")
    _check_layouts(results, LAYOUTS, ref)
