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


# Llama 2 / 3's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_LLAMA_PRESETS: dict[str, dict] = {
    "llama2_7b": dict(),
    "llama2_13b": dict(hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40),
    "llama2_70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
    "llama3_8b": dict(
        vocab_size=128256,
        intermediate_size=14336,
        num_kv_heads=8,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}

LLAMA = DecoderSpec(
    "llama",
    {**COMMON, "attention_bias": READ, "mlp_bias": READ},
    _llama_read,
    _llama_write,
    causal_lm="LlamaForCausalLM",
    llava=("llava_llama", "LlavaLlamaForCausalLM"),
    presets=_LLAMA_PRESETS,
)


# Mistral's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_MISTRAL_PRESETS: dict[str, dict] = {
    "mistral_7b": dict(
        intermediate_size=14336,
        num_kv_heads=8,
        max_seq_len=32768,
        family="mistral",
        sliding_window=4096,
    ),
    # Mistral Small 3.1's decoder (mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json text_config: 40 layers of
    # width 5120, intermediate 32768, 32 heads of 128, 8 KV heads, rope_theta 1e9, rms_norm_eps 1e-5, no sliding
    # window, vocabulary 131072, untied head).
    "mistral_small_3_1_24b": dict(
        vocab_size=131072,
        hidden_size=5120,
        intermediate_size=32768,
        num_layers=40,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_seq_len=131072,
        rope_theta=1e9,
        rms_norm_eps=1e-5,
        family="mistral",
    ),
}

MISTRAL = DecoderSpec(
    "mistral",
    {**COMMON, "sliding_window": READ},
    lambda hf: dict(sliding_window=hf.get("sliding_window")),
    _mistral_write,
    causal_lm="MistralForCausalLM",
    llava=("llava_mistral", "LlavaMistralForCausalLM"),
    presets=_MISTRAL_PRESETS,
)
