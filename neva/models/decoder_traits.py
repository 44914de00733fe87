"""What a decoder family implies beyond ``LLMConfig``'s fields (its ``DecoderSpec.traits``, ``neva.families``), and
the checks of the per-layer fields that Gemma 3 brought.

Gemma 3's decoder (HF ``Gemma3TextModel``) is neva's one decoder with these traits, which its family implies rather
than configures (every released Gemma 3 has them all):

- RMSNorms scale by ``1 + w`` (weights stored centred on 0, initialised to 0), computed in fp32 and cast after;
- four norms per block: before and after attention, before and after the feed-forward (``post_attention_norm``,
  ``post_ffn_norm``: the outputs are normalised before each residual add);
- token embeddings scaled by √hidden (in the embedding's dtype, as HF rounds it), image features not;
- a gated tanh-GELU feed-forward (``gelu_pytorch_tanh`` where Llama has SiLU);
- per-head q / k norms (``qk_norm``);
- each image's tokens attend to one another in both directions inside the causal decoder (HF's ``token_type_ids``
  blocks): a rule of the attention plan (``neva.models.attention``), not a dense mask.

Its configured facts are ``LLMConfig`` fields: ``layer_types`` (interleaved sliding-window / global layers),
``rope_local_theta`` (the sliding layers' RoPE base), ``query_pre_attn_scalar`` (the attention scale) and
``final_logit_softcapping``. Its projector (``ProjectorConfig.type`` ``gemma3``) is ``neva.models.projector_gemma3``.
Generic code asks ``traits(llm)``, never the family's name.
"""

from __future__ import annotations

import math
from typing import Any

from neva.families import decoder_spec
from neva.families.decoder_spec import DecoderTraits

LAYER_TYPES = ("sliding_attention", "full_attention", "chunked_attention")


def traits(llm: Any) -> DecoderTraits:
    """The traits of an ``LLMConfig``'s family (its ``DecoderSpec.traits``)."""
    return decoder_spec(llm.family).traits


def norm_offset(llm: Any) -> float:
    """What the decoder's RMSNorms add to their weight before scaling: 1 where the family implies it (Gemma 3) or
    the config says so (``layernorm_zero_centered_gamma``: Qwen3.5, Megatron's name), else 0."""
    return 1.0 if llm.layernorm_zero_centered_gamma else traits(llm).norm_offset


def embed_scale(llm: Any) -> float | None:
    """The factor token embeddings are multiplied by (None: none)."""
    return math.sqrt(llm.hidden_size) if traits(llm).scaled_embeddings else None


def check_decoder_fields(llm: Any) -> None:
    """``LLMConfig``'s layer-type, local RoPE, attention-scale and softcap fields, and what the gemma3 family needs.

    Raises:
        ValueError: a layer type neva has no rule for, a list of the wrong length, a local RoPE base without
            sliding layers, a non-positive scale or softcap, a gemma3 decoder without q / k norms.
    """
    if llm.layer_types is not None:
        llm.layer_types = list(llm.layer_types)
        bad = sorted(set(llm.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types {bad}: each must be one of {', '.join(LAYER_TYPES)}")
        if len(llm.layer_types) != llm.num_layers:
            raise ValueError(f"layer_types has {len(llm.layer_types)} entries for {llm.num_layers} layers")
        if "sliding_attention" in llm.layer_types and llm.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        if "chunked_attention" in llm.layer_types and not llm.attention_chunk_size:
            raise ValueError("layer_types has chunked_attention layers but attention_chunk_size is None")
    if llm.attention_chunk_size is not None and "chunked_attention" not in (llm.layer_types or ()):
        raise ValueError("attention_chunk_size is the chunk of chunked_attention layers: layer_types has none")
    if llm.nope_layers is not None:
        llm.nope_layers = sorted(int(i) for i in llm.nope_layers)
        if any(not 0 <= i < llm.num_layers for i in llm.nope_layers):
            raise ValueError(f"nope_layers {llm.nope_layers}: each must be a layer index below {llm.num_layers}")
    if llm.attn_temperature_floor_scale is not None and llm.attn_temperature_floor_scale < 1:
        raise ValueError(f"attn_temperature_floor_scale must be >= 1 or None, got {llm.attn_temperature_floor_scale}")
    if llm.rope_local_theta is not None and "sliding_attention" not in (llm.layer_types or ()):
        raise ValueError("rope_local_theta is the RoPE base of sliding_attention layers: layer_types has none")
    for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
        value = getattr(llm, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive or None, got {value}")


def sliding(llm: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` attends within ``sliding_window`` (every layer does without ``layer_types``)."""
    if llm.sliding_window is None:
        return False
    return llm.layer_types is None or llm.layer_types[layer] == "sliding_attention"


def chunk(llm: Any, layer: int) -> int | None:
    """The attention chunk of decoder layer ``layer`` (Llama 4's ``chunked_attention`` layers), else None."""
    if llm.layer_types is None or llm.layer_types[layer] != "chunked_attention":
        return None
    return llm.attention_chunk_size


def temperature_tuned(llm: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` scales its queries by their position (Llama 4's NoPE layers)."""
    return llm.attn_temperature_floor_scale is not None and not llm.uses_rope(layer)
