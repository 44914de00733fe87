"""The Llama-family decoders of LLaVA-style models: Llama-2/3 (HF ``attention_bias`` / ``mlp_bias``) and Mistral
(a sliding window)."""

from __future__ import annotations

from typing import Any

from neva.families.decoder_spec import DecoderSpec
from neva.families.hf_fields import COMMON, READ


def _llama_read(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


def _llama_write(llm: Any) -> dict[str, Any] | None:
    if llm.qkv_bias != llm.o_bias or llm.sliding_window is not None or llm.is_moe:
        return None
    return dict(attention_bias=llm.qkv_bias, mlp_bias=llm.mlp_bias)


def _mistral_write(llm: Any) -> dict[str, Any] | None:
    biased = llm.qkv_bias or llm.o_bias or llm.mlp_bias
    return None if biased or llm.is_moe else dict(sliding_window=llm.sliding_window)


LLAMA = DecoderSpec(
    "llama",
    {**COMMON, "attention_bias": READ, "mlp_bias": READ},
    _llama_read,
    _llama_write,
    causal_lm="LlamaForCausalLM",
    llava=("llava_llama", "LlavaLlamaForCausalLM"),
)
MISTRAL = DecoderSpec(
    "mistral",
    {**COMMON, "sliding_window": READ},
    lambda hf: dict(sliding_window=hf.get("sliding_window")),
    _mistral_write,
    causal_lm="MistralForCausalLM",
    llava=("llava_mistral", "LlavaMistralForCausalLM"),
)
