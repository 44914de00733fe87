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


LLAMA4 = DecoderSpec(
    "llama4_text",
    fields=None,  # read by its own interop (neva.checkpoint.hf_llama4), every field ruled on there
    read=None,
    write=None,
    moe=True,
    causal_lm="Llama4ForCausalLM",
    interop="neva.checkpoint.hf_llama4:LLAMA4_INTEROP",
    check=_check,
)
