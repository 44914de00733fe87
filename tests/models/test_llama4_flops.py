"""Llama 4's terms in the FLOP model and the planner: a chunked layer's attention core counts the squares of the
sample's chunks, a NoPE global layer the whole square; the dense and MoE layers' feed-forwards each at their own
width (the dense ones whole, the experts at k / E, the shared expert whole); the planner's activations and expert
all-to-alls count only the MoE layers as MoE."""

from __future__ import annotations

import torch

from neva.models.config import LLMConfig, NevaConfig
from neva.models.flops import SampleFlops, chunked_square, flop_terms, model_params
from neva.models.neva import NevaModel
from neva.models.presets import LLM_PRESETS, build_config


def test_chunked_layers_count_their_chunks_dense_and_moe_layers_their_widths():
    llm = LLMConfig(**LLM_PRESETS["tiny_llama4"])
    cfg = NevaConfig(llm=llm, vision=None, projector=None, image_token_id=llm.vocab_size)
    with torch.device("meta"):
        model = NevaModel(cfg)
    terms = {t.name: t for t in flop_terms(model_params(model), cfg)}
    cores = [terms[f"llm.layers.{i}.attention.core"] for i in range(4)]
    assert [t.per for t in cores] == ["token2_chunked"] * 3 + ["token2_full"]
    assert chunked_square(40, 16) == 2 * 16 * 16 + 8 * 8
    flops = SampleFlops.of(model)
    seq = 40
    no_core = SampleFlops(flops.per_token, 0.0, flops.per_image, flops.window, flops.per_frame, 0.0)
    expected = sum(t.total for t in cores[:3]) * chunked_square(seq, 16) + cores[3].total * seq * seq
    assert flops.sample(seq, 0) - no_core.sample(seq, 0) == expected
    h = llm.hidden_size
    assert terms["llm.layers.0.feed_forward.w1.weight"].forward == 2 * h * 352  # dense: its own width
    assert terms["llm.layers.1.feed_forward.experts.w1"].forward == 2 * 4 * h * 176 / 4  # top-1 of 4 experts
    assert terms["llm.layers.1.feed_forward.shared_expert.w1.weight"].forward == 2 * h * 176


def test_planner_counts_only_the_moe_layers_as_moe():
    from neva.planner.activations import _ffn_elements
    from neva.planner.perf import _all_to_alls

    cfg = build_config("tiny_llama4")
    assert _ffn_elements(cfg, 10, 2, layer=0) == (10 * 352 / 2, 0.0)
    assert _ffn_elements(cfg, 10, 2, layer=1) == (10 * 176 + 10 * 176, 10 * 128)  # top-1 expert, shared expert
    assert _all_to_alls(cfg, [0, 1, 2, 3], frozenset(), backward=True) == 2 * 4
