"""Qwen3.5's decoders (``qwen3_5_text`` / ``qwen3_5_moe_text`` under ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``, neva/checkpoint/hf_qwen_vl.py): Qwen3's attention with an output gate and
``(1 + w)`` norms in the layers ``layer_types`` names ``full_attention``, Gated DeltaNet in the others
(neva/models/gated_deltanet.py); the MoE's every block 8-of-N routed experts and a gated shared expert. The rotary
share (``partial_rotary_factor``) comes with the rope parameters (hf_qwen_vl)."""

from __future__ import annotations

from typing import Any

from neva.families.decoder_spec import DecoderSpec
from neva.families.hf_fields import COMMON, INERT, READ
from neva.families.qwen import QWEN3, _qwen3_read

# HF Qwen3.5 text field: ``LinearAttentionConfig`` field (neva/models/hybrid_config.py), and transformers' default.
_LINEAR_FIELDS = {
    "linear_conv_kernel_dim": ("conv_kernel_dim", 4),
    "linear_key_head_dim": ("key_head_dim", 128),
    "linear_value_head_dim": ("value_head_dim", 128),
    "linear_num_key_heads": ("num_key_heads", 16),
    "linear_num_value_heads": ("num_value_heads", 32),
}


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(layers)
    ]
    # a plain dict: LLMConfig builds its LinearAttentionConfig (the models package sits above this one)
    linear = dict(
        layer_types=types, **{ours: hf.get(theirs, default) for theirs, (ours, default) in _LINEAR_FIELDS.items()}
    )
    fields = dict(
        _qwen3_read(hf), linear_attention=linear, attention_output_gate=True, layernorm_zero_centered_gamma=True
    )
    if "num_experts" in hf:  # Qwen3.5-MoE: every block sparse, a gated shared expert beside the routed ones
        fields.update(
            num_moe_experts=hf["num_experts"],
            moe_router_topk=hf["num_experts_per_tok"],
            intermediate_size=hf["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
            moe_shared_expert_gate=True,
        )
    return fields


def _write(llm: Any) -> dict[str, Any] | None:
    la = llm.linear_attention
    hybrid = la is not None and llm.attention_output_gate and llm.layernorm_zero_centered_gamma and llm.qk_norm
    plain = llm.qkv_bias == llm.o_bias and not llm.mlp_bias and llm.sliding_window is None
    if not hybrid or not plain or llm.is_moe != (llm.family == "qwen3_5_moe"):
        return None
    out = dict(
        attention_bias=llm.qkv_bias,
        layer_types=list(la.layer_types),
        **{theirs: getattr(la, ours) for theirs, (ours, _) in _LINEAR_FIELDS.items()},
    )
    if llm.is_moe:
        if not llm.moe_shared_expert_intermediate_size or not llm.moe_shared_expert_gate:
            return None
        out.update(
            num_experts=llm.num_moe_experts,
            num_experts_per_tok=llm.moe_router_topk,
            moe_intermediate_size=llm.intermediate_size,
            shared_expert_intermediate_size=llm.moe_shared_expert_intermediate_size,
        )
    return out


_FIELDS = {
    **COMMON,
    "attention_bias": READ,
    "layer_types": READ,
    "full_attention_interval": READ,
    **{name: READ for name in _LINEAR_FIELDS},
}


# Qwen3.5's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_QWEN3_5_PRESETS: dict[str, dict] = {
    # The tiny Qwen3 decoder as Qwen3.5's hybrid: Gated DeltaNet in layers 0-2 (2 query / key heads of 32 serving 4
    # value heads of 32, 4 conv taps), gated attention with RoPE on a quarter of each head in layer 3, (1 + w) norms.
    "tiny_qwen3_5": dict(
        QWEN3.presets["tiny_qwen3"],
        family="qwen3_5",
        attention_output_gate=True,
        rotary_percent=0.25,
        layernorm_zero_centered_gamma=True,
        linear_attention=dict(
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            conv_kernel_dim=4,
            key_head_dim=32,
            value_head_dim=32,
            num_key_heads=2,
            num_value_heads=4,
        ),
    ),
}

QWEN3_5 = DecoderSpec("qwen3_5", _FIELDS, _read, _write, linear_attention=True, presets=_QWEN3_5_PRESETS)


# Qwen3.5-MoE's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_QWEN3_5_MOE_PRESETS: dict[str, dict] = {
    # Qwen/Qwen3.5-35B-A3B's decoder (transformers 5.25 Qwen3_5MoeTextConfig defaults, documented as that checkpoint):
    # 40 layers of width 2048, Gated DeltaNet in three of every four (16 key heads serving 32 value heads of 128, 4
    # conv taps), gated attention in the fourth (16 heads of 256, 2 KV heads, RoPE on a quarter: M-RoPE [11, 11, 10]
    # interleaved), 256 experts of width 512 (8 per token) and a gated shared expert of 512 in every block.
    "qwen3_5_35b_a3b": dict(
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=512,
        num_layers=40,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        max_seq_len=32768,
        rms_norm_eps=1e-6,
        family="qwen3_5_moe",
        qk_norm=True,
        attention_output_gate=True,
        rotary_percent=0.25,
        layernorm_zero_centered_gamma=True,
        mrope_section=[11, 11, 10],
        mrope_interleaved=True,
        num_moe_experts=256,
        moe_router_topk=8,
        moe_shared_expert_intermediate_size=512,
        moe_shared_expert_gate=True,
        linear_attention=dict(
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
            conv_kernel_dim=4,
            key_head_dim=128,
            value_head_dim=128,
            num_key_heads=16,
            num_value_heads=32,
        ),
    ),
}

QWEN3_5_MOE = DecoderSpec(
    "qwen3_5_moe",
    {
        **_FIELDS,
        "intermediate_size": INERT,  # no dense block (every feed-forward is the experts and the shared expert)
        "moe_intermediate_size": READ,
        "shared_expert_intermediate_size": READ,
        "num_experts": READ,
        "num_experts_per_tok": READ,
        "router_aux_loss_coef": INERT,  # a neva run's own moe_aux_loss_coeff
        "output_router_logits": INERT,
    },
    _read,
    _write,
    moe=True,
    linear_attention=True,
    presets=_QWEN3_5_MOE_PRESETS,
)
