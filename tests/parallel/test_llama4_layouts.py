"""Llama 4's decoder (the tiny one: chunked RoPE layers, a NoPE layer with temperature tuning, dense and MoE layers
interleaved, top-1 sigmoid routing on the experts' inputs, a shared expert) behind the tiny CLIP tower on LLaVA-format
data, under TP2+SP, PP2, DP2 ZeRO-3 and EP2: each equals one process per step; CP refused in one line (its chunks)."""

from __future__ import annotations

import pytest

from neva.typed import ConfigError

from .harness import make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set
from .test_native_layouts import EP2, LAYOUTS
from .test_parallel_training import _check_layouts

MODEL = ["model=tiny_llama4"]


@pytest.mark.slow
def test_llama4_layouts_match_one_process(tmp_path):
    llava_dir = tmp_path / "llava"
    write_llava_set(llava_dir)
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama_clip", extra=MODEL)
    data = [f"model.restore_from_path={ckpt}", *MODEL, *llava_overrides(llava_dir, True)]
    ref = train_losses(data, 2)
    layouts = {**LAYOUTS, **EP2}
    results = run_layouts(2, [(name, data + o, 2) for name, o in layouts.items()], tmp_path / "layouts")
    _check_layouts(results, layouts, ref)


def test_context_parallel_refused_with_chunked_attention():
    from neva.models.presets import build_config
    from neva.parallel.context_parallel import check_context_parallel_model

    class Layout:
        cp = 2

    with pytest.raises(ConfigError) as err:
        check_context_parallel_model(Layout(), build_config("tiny_llama4").llm)
    assert len(str(err.value).splitlines()) == 1 and "chunked_attention" in str(err.value)
