"""Llama 4's decoder (HF ``llama4_text``: ``Llama4ForCausalLM``, the text side of ``Llama4ForConditionalGeneration``).

What its layers compute is ``LLMConfig``'s fields (neva/models/config.py, "Llama 4"): chunked local attention on the
RoPE layers (``layer_types`` ``chunked_attention``, ``attention_chunk_size``) interleaved with global NoPE layers
(``nope_layers``), weightless q / k RMS norms on the RoPE layers (``qk_l2_norm``), query temperature tuning on the
NoPE layers (``attn_temperature_floor_scale`` / ``attn_temperature_scale``), Llama 3-scaled RoPE, and an MoE
feed-forward (``moe_layer_freq``: MoE and dense layers interleaved, the dense ones ``dense_intermediate_size`` wide)
whose router takes the sigmoid of each token's top-k logits and scales the expert's *input* by it
(``moe_router_score_function`` sigmoid, ``moe_apply_probs_on_input``), beside an ungated shared expert as wide as
each routed one. HF rotates interleaved channel pairs (complex RoPE); neva's RoPE is half-split, so the interop
permutes each head's q / k rows (neva/checkpoint/hf_llama4.py), which changes no dot product.

The vision side (``Llama4VisionModel``, its pixel-shuffle adapter and the processor's tiles) is not built: the
family's interop imports and exports the text model, and refuses ``Llama4ForConditionalGeneration`` in one line.
"""

from __future__ import annotations

from neva.families.decoder_spec import DecoderSpec


def _check(llm) -> None:
    if llm.moe_router_score_function != "sigmoid" or not llm.moe_apply_probs_on_input:
        raise ValueError("a llama4_text decoder routes by sigmoid scores on the experts' inputs")


# Llama 4's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_LLAMA4_PRESETS: dict[str, dict] = {
    # The tiny decoder as Llama 4's: chunked attention (16-token chunks) with RoPE and weightless q / k norms in
    # layers 0-2, a global NoPE layer 3 with query temperature tuning (floor_scale 16, so that it acts at the tiny
    # lengths; Llama 4's is 8192), Llama 3-scaled RoPE; dense layers 0 and 2 (width 352), MoE layers 1 and 3: 4
    # experts of width 176, top-1 sigmoid scores on the experts' inputs, a shared expert of 176.
    "tiny_llama4": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=176,
        dense_intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_seq_len=512,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        family="llama4_text",
        layer_types=["chunked_attention"] * 3 + ["full_attention"],
        attention_chunk_size=16,
        nope_layers=[3],
        qk_l2_norm=True,
        attn_temperature_floor_scale=16,
        attn_temperature_scale=0.1,
        num_moe_experts=4,
        moe_router_topk=1,
        moe_layer_freq=[0, 1, 0, 1],
        moe_shared_expert_intermediate_size=176,
        moe_router_score_function="sigmoid",
        moe_apply_probs_on_input=True,
    ),
}

LLAMA4 = DecoderSpec(
    "llama4_text",
    fields=None,  # read by its own interop (neva.checkpoint.hf_llama4), every field ruled on there
    read=None,
    write=None,
    moe=True,
    causal_lm="Llama4ForCausalLM",
    interop="neva.checkpoint.hf_llama4:LLAMA4_INTEROP",
    check=_check,
    presets=_LLAMA4_PRESETS,
)
