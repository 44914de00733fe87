"""Mistral 3 (the tiny Pixtral tower, Mistral 3's merging projector, a Mistral decoder) on LLaVA-format data — images
of five sizes each at its own grid (rows closed by [IMG_BREAK] / [IMG_END]), text-only and two-image samples, packed
rows — under TP2+SP (the projector's three Linear layers sharded, its norm replicated; the tower replicated), PP2
(tower and projector on stage 0), DP2 ZeRO-3 and CP2 (each rank encodes its share of the images, the features
gathered): each equals one process per step."""

from __future__ import annotations

import pytest

from .harness import FAMILIES, make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set
from .test_native_layouts import HYBRID
from .test_parallel_training import _check_layouts

pytestmark = pytest.mark.slow

FAMILY = "mistral3_pixtral"


def test_mistral3_layouts_match_one_process(tmp_path):
    llava_dir = tmp_path / "llava"
    write_llava_set(llava_dir)
    ckpt = make_checkpoint(tmp_path / "ckpt", FAMILY)
    data = [f"model.restore_from_path={ckpt}", *FAMILIES[FAMILY], *llava_overrides(llava_dir, True)]
    data.append("model.data.conv_template=mistral")
    ref = train_losses(data, 2)
    results = run_layouts(2, [(name, data + o, 2) for name, o in HYBRID.items()], tmp_path / "layouts")
    _check_layouts(results, HYBRID, ref)
