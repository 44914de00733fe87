"""Gemma 3's terms in the FLOP model and the planner: a sliding layer's attention core counts the window's band, a
global layer between sliding ones the whole square (Mistral's one window applies to every layer), and the parameters
Gemma adds (post norms, the projector's RMSNorm and linear, the tower's post-LayerNorm it reads) have their place."""

from __future__ import annotations

import torch

from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig
from neva.models.flops import SampleFlops, attended_square, flop_terms, model_params
from neva.models.neva import NevaModel
from neva.models.presets import LLM_PRESETS, VISION_PRESETS


def _tiny_gemma3() -> NevaModel:
    llm, vision = LLMConfig(**LLM_PRESETS["tiny_gemma3"]), VisionConfig(**VISION_PRESETS["tiny_gemma3"])
    projector = ProjectorConfig(type="gemma3", input_size=64, output_size=128, bias=False, tokens_per_image=4)
    with torch.device("meta"):
        return NevaModel(NevaConfig(llm=llm, vision=vision, projector=projector, image_token_id=511))


def test_sliding_layers_count_the_band_global_layers_the_square():
    model = _tiny_gemma3()
    cfg = model.cfg
    terms = flop_terms(model_params(model), cfg)
    cores = [t for t in terms if t.name.startswith("llm.") and t.name.endswith("attention.core")]
    assert [t.per for t in cores] == ["token2", "token2_full", "token2", "token2_full"]  # the preset's layer_types
    seq = 100  # > the window (16)
    expected = sum(t.total * (attended_square(seq, 16) if t.per == "token2" else seq * seq) for t in cores)
    flops = SampleFlops.of(model)
    no_attention = SampleFlops(flops.per_token, 0.0, flops.per_image, flops.window, flops.per_frame, 0.0)
    assert flops.sample(seq, 1) - no_attention.sample(seq, 1) == expected
    names = {t.name for t in terms}
    # the projector's linear runs on the pooled tokens; the post norms and the tower's post-LayerNorm have no matmul
    assert "projector.proj.weight" in names and "projector.norm.weight" not in names
    proj = next(t for t in terms if t.name == "projector.proj.weight")
    assert (proj.per, proj.forward) == ("image", 2 * 64 * 128 * cfg.num_image_tokens)
