"""The Qwen decoders: Qwen2 (biased q/k/v, tied embeddings in the small sizes), Qwen3 (per-head q / k RMSNorms before
RoPE) and Qwen3-MoE. Qwen3-VL's decoder (``qwen3_vl_text``) is Qwen3 with M-RoPE, Qwen3-VL-MoE's
(``qwen3_vl_moe_text``) Qwen3-MoE (neva/checkpoint/hf_qwen_vl.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from neva.families.decoder_spec import DecoderSpec
from neva.families.hf_fields import COMMON, INERT, READ, Needs


def _qwen2_write(llm: Any) -> dict[str, Any] | None:
    expressible = (llm.qkv_bias, llm.o_bias, llm.mlp_bias) == (True, False, False) and llm.sliding_window is None
    expressible = expressible and not llm.is_moe
    return dict(use_sliding_window=False) if expressible else None


def _qwen3_read(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True)


def _qwen3_write(llm: Any) -> dict[str, Any] | None:
    expressible = llm.qk_norm and llm.qkv_bias == llm.o_bias and not llm.mlp_bias and llm.sliding_window is None
    return dict(attention_bias=llm.qkv_bias) if expressible and not llm.is_moe else None


def _qwen3_moe_read(hf: dict[str, Any]) -> dict[str, Any]:
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    # Every block sparse (decoder_sparse_step 1, no mlp_only_layers): the dense intermediate_size is never used and
    # neva's intermediate_size is each expert's width.
    return dict(
        _qwen3_read(hf),
        num_moe_experts=experts,
        moe_router_topk=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
    )


def _qwen3_moe_write(llm: Any) -> dict[str, Any] | None:
    dense = dataclasses.replace(llm, num_moe_experts=None, family="qwen3")
    if not llm.is_moe or _qwen3_write(dense) is None:
        return None
    return dict(
        _qwen3_write(dense),
        num_experts=llm.num_moe_experts,
        num_experts_per_tok=llm.moe_router_topk,
        moe_intermediate_size=llm.intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


# Qwen2's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_QWEN2_PRESETS: dict[str, dict] = {
    "tiny_qwen2": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=512,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        family="qwen2",
        qkv_bias=True,
        tie_word_embeddings=True,
    ),
    "qwen2_7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        max_seq_len=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        family="qwen2",
        qkv_bias=True,
    ),
}

QWEN2 = DecoderSpec(
    "qwen2",
    {
        **COMMON,
        "use_sliding_window": Needs((False,), "Qwen2's per-layer sliding windows are not implemented"),
        # Only read with use_sliding_window (refused above): the layers all attend fully.
        "sliding_window": INERT,
        "max_window_layers": INERT,
        "layer_types": READ,  # checked: every layer full attention
    },
    lambda hf: dict(qkv_bias=True),  # q/k/v biased, o_proj not
    _qwen2_write,
    causal_lm="Qwen2ForCausalLM",
    llava=("llava_qwen", "LlavaQwenForCausalLM"),
    presets=_QWEN2_PRESETS,
)


# Qwen3's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_QWEN3_PRESETS: dict[str, dict] = {
    # The tiny decoder as Qwen3's: q / k RMSNorms per head, no biases, untied (a pipeline can split it).
    "tiny_qwen3": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_seq_len=512,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        family="qwen3",
        qk_norm=True,
    ),
}

QWEN3 = DecoderSpec(
    "qwen3",
    {
        **COMMON,
        "attention_bias": READ,
        "use_sliding_window": Needs((False,), "Qwen3's per-layer sliding windows are not implemented"),
        "sliding_window": INERT,  # only read with use_sliding_window (refused above)
        "max_window_layers": INERT,
        "layer_types": READ,  # checked: every layer full attention
    },
    _qwen3_read,
    _qwen3_write,
    presets=_QWEN3_PRESETS,
)
# Every block a sparse MoE of ``moe_intermediate_size``-wide SwiGLU experts with Mixtral's routing (softmax, top-k
# renormalised), no shared experts.
QWEN3_MOE = DecoderSpec(
    "qwen3_moe",
    {
        **COMMON,
        "intermediate_size": INERT,  # the dense MLP's width: no block is dense (rules below)
        "attention_bias": READ,
        "moe_intermediate_size": READ,
        "num_experts": READ,
        "num_local_experts": READ,
        "num_experts_per_tok": READ,
        "decoder_sparse_step": Needs((1,), "dense blocks between sparse ones are not implemented"),
        "mlp_only_layers": Needs(([],), "dense blocks between sparse ones are not implemented"),
        "norm_topk_prob": Needs((True,), "neva's router renormalises the top-k probabilities"),
        "router_aux_loss_coef": INERT,  # a neva run's own moe_aux_loss_coeff (as Mixtral's)
        "output_router_logits": INERT,
        "use_sliding_window": Needs((False,), "Qwen3's per-layer sliding windows are not implemented"),
        "sliding_window": INERT,
        "max_window_layers": INERT,
        "layer_types": READ,
    },
    _qwen3_moe_read,
    _qwen3_moe_write,
    moe=True,
)
