"""Which HF decoder configs neva reads, field by field: every field is read, known not to change the computation, or
refused naming the field and its value.

One entry per ``model_type`` (``FAMILIES``): a dict ``field -> rule``, how its fields become ``LLMConfig``'s and how an
export writes them back. A rule is ``READ`` (translated into an ``LLMConfig`` field by ``llm_config_from_hf``),
``INERT`` (does not change what the forward computes: ids, bookkeeping, generation defaults, initialisation), or
``Needs(values, why)`` (only these values are implemented; any other is refused).
A field in no table is refused too: an unknown field may change the computation, and guessing would train another
model than the one asked for. A new family is one more entry (its fields built from ``COMMON``); a family named in
``NOT_YET`` is refused with its reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from neva.models.hybrid_config import LinearAttentionConfig
from neva.typed import ConfigError


@dataclass(frozen=True)
class Read:
    """Translated by ``llm_config_from_hf``."""


@dataclass(frozen=True)
class Needs:
    """Only one of ``values`` is implemented; anything else is refused with ``why``."""

    values: tuple[Any, ...]
    why: str


@dataclass(frozen=True)
class Inert:
    """Known not to change the forward computation."""


READ, INERT = Read(), Inert()

# transformers' PretrainedConfig fields (4.x and 5.x) and common bookkeeping: none changes a decoder's forward.
_CONFIG_BOOKKEEPING = (
    "_name_or_path", "architectures", "transformers_version", "model_type", "dtype", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range",
    "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "return_dict", "output_attentions", "output_hidden_states", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "pruned_heads",
    # generation defaults a 4.x config still carries (generation is configured by neva.generate's own flags)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # Llama's tensor-parallel pretraining split: the same product computed in slices (HF 4.x only, same result).
    "pretraining_tp",
)  # fmt: skip
CONFIG_BOOKKEEPING = _CONFIG_BOOKKEEPING  # also the bookkeeping of top-level multimodal configs (hf_video)

COMMON: dict[str, Any] = {
    **{name: INERT for name in _CONFIG_BOOKKEEPING},
    **{
        name: READ
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
    },
    "hidden_act": Needs(("silu",), "neva's decoder MLP is SwiGLU (silu)"),
    "attention_dropout": Needs((0.0, 0), "neva's decoder has no attention dropout"),
}


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


def _mixtral_read(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(
        sliding_window=hf.get("sliding_window"),
        num_moe_experts=hf["num_local_experts"],
        moe_router_topk=hf.get("num_experts_per_tok", 2),
    )


def _mixtral_write(llm: Any) -> dict[str, Any] | None:
    if llm.qkv_bias or llm.o_bias or llm.mlp_bias:
        return None
    return dict(
        sliding_window=llm.sliding_window,
        num_local_experts=llm.num_moe_experts,
        num_experts_per_tok=llm.moe_router_topk,
        router_jitter_noise=0.0,
    )


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


_LINEAR_FIELDS = {  # HF Qwen3.5 text field: LinearAttentionConfig field
    "linear_conv_kernel_dim": "conv_kernel_dim",
    "linear_key_head_dim": "key_head_dim",
    "linear_value_head_dim": "value_head_dim",
    "linear_num_key_heads": "num_key_heads",
    "linear_num_value_heads": "num_value_heads",
}


def _qwen3_5_read(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's decoder: Qwen3's attention with an output gate and (1 + w) norms, Gated DeltaNet layers where
    ``layer_types`` says (rotary_percent comes with the rope parameters: ``hf_qwen_vl``)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(layers)
    ]
    defaults = LinearAttentionConfig()
    linear = LinearAttentionConfig(
        layer_types=types, **{ours: hf.get(theirs, getattr(defaults, ours)) for theirs, ours in _LINEAR_FIELDS.items()}
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


def _qwen3_5_write(llm: Any) -> dict[str, Any] | None:
    la = llm.linear_attention
    hybrid = la is not None and llm.attention_output_gate and llm.layernorm_zero_centered_gamma and llm.qk_norm
    plain = llm.qkv_bias == llm.o_bias and not llm.mlp_bias and llm.sliding_window is None
    if not hybrid or not plain or llm.is_moe != (llm.family == "qwen3_5_moe"):
        return None
    out = dict(
        attention_bias=llm.qkv_bias,
        layer_types=list(la.layer_types),
        **{theirs: getattr(la, ours) for theirs, ours in _LINEAR_FIELDS.items()},
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


_QWEN3_5 = {
    **COMMON,
    "attention_bias": READ,
    "layer_types": READ,
    "full_attention_interval": READ,
    **{name: READ for name in _LINEAR_FIELDS},
}
_QWEN3_5_MOE = {
    **_QWEN3_5,
    "intermediate_size": INERT,  # no dense block (every feed-forward is the experts and the shared expert)
    "moe_intermediate_size": READ,
    "shared_expert_intermediate_size": READ,
    "num_experts": READ,
    "num_experts_per_tok": READ,
    "router_aux_loss_coef": INERT,  # a neva run's own moe_aux_loss_coeff
    "output_router_logits": INERT,
}
# Decoders whose layer_types may name linear-attention layers.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")


@dataclass(frozen=True)
class Family:
    """One HF ``model_type``: its fields' rules, its ``LLMConfig`` family fields from a checked config (``read``), and
    the HF fields an export writes for an ``LLMConfig`` (``write``; None: the HF class cannot express it)."""

    fields: dict[str, Any]
    read: Callable[[dict[str, Any]], dict[str, Any]]
    write: Callable[[Any], dict[str, Any] | None]


FAMILIES: dict[str, Family] = {
    "llama": Family({**COMMON, "attention_bias": READ, "mlp_bias": READ}, _llama_read, _llama_write),
    "mistral": Family(
        {**COMMON, "sliding_window": READ}, lambda hf: dict(sliding_window=hf.get("sliding_window")), _mistral_write
    ),
    "qwen2": Family(
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
    ),
    # Qwen3: per-head q / k RMSNorms before RoPE, unbiased projections unless attention_bias, explicit head_dim.
    # Qwen3-VL's decoder (``qwen3_vl_text``) is this family with M-RoPE (neva/checkpoint/hf_qwen_vl.py).
    "qwen3": Family(
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
    ),
    # Qwen3-MoE (Qwen3-VL-MoE's decoder, ``qwen3_vl_moe_text``): Qwen3's attention, every block a sparse MoE of
    # ``moe_intermediate_size``-wide SwiGLU experts with Mixtral's routing (softmax, top-k renormalised), no shared
    # experts.
    "qwen3_moe": Family(
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
    ),
    # Mixtral: Mistral's attention with a sparse MoE feed-forward (neva/models/moe.py).
    "mixtral": Family(
        {
            **COMMON,
            "sliding_window": READ,
            "num_local_experts": READ,
            "num_experts_per_tok": READ,
            "router_jitter_noise": Needs((0, 0.0), "router jitter (training-time input noise) is not implemented"),
            # transformers adds the aux loss only with output_router_logits; a neva run's coefficient is its own
            # moe_aux_loss_coeff (neva/models/moe.py), so neither changes the forward.
            "router_aux_loss_coef": INERT,
            "output_router_logits": INERT,
        },
        _mixtral_read,
        _mixtral_write,
    ),
    # Qwen3.5 / Qwen3.5-MoE's decoders (``qwen3_5_text`` / ``qwen3_5_moe_text``; neva/models/gated_deltanet.py).
    "qwen3_5": Family(_QWEN3_5, _qwen3_5_read, _qwen3_5_write),
    "qwen3_5_moe": Family(_QWEN3_5_MOE, _qwen3_5_read, _qwen3_5_write),
}

NOT_YET = {
    "qwen2_moe": "Qwen2-MoE's shared experts are not implemented",
    "gemma": "Gemma's GeGLU MLP, scaled embeddings and (1 + w) RMSNorm are not implemented",
    "gemma2": "Gemma-2's soft-capping, GeGLU and alternating windows are not implemented",
    "phi3": "Phi-3's fused qkv / gate_up projections are not implemented",
}


def check_fields(hf: dict[str, Any], where: str = "LLM config") -> str:
    """The family of an HF decoder config dict; raises ``ConfigError`` naming every field neva would not honour.

    ``model_type`` missing is read as ``llama`` (old Llama ``config.json`` files and NeMo/LLaVA dicts without it).
    """
    family = hf.get("model_type") or "llama"
    if family in NOT_YET:
        raise ConfigError(f"{where}: model_type {family!r} is not supported yet ({NOT_YET[family]})")
    if family not in FAMILIES:
        raise ConfigError(f"{where}: model_type {family!r} is not a supported decoder family ({sorted(FAMILIES)})")
    table, problems = FAMILIES[family].fields, []
    for name, value in hf.items():
        rule = table.get(name)
        if rule is None:
            problems.append(f"{name}={value!r} (unknown to neva: it may change the computation)")
        elif isinstance(rule, Needs) and value not in rule.values:
            problems.append(f"{name}={value!r} ({rule.why})")
    layer_types = hf.get("layer_types")
    if layer_types is not None and family not in HYBRID_FAMILIES and any(t != "full_attention" for t in layer_types):
        problems.append(f"layer_types={layer_types!r} (only full_attention layers are implemented)")
    if problems:
        raise ConfigError(f"{where} ({family}): refused field(s): " + "; ".join(problems))
    return family


def family_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The ``LLMConfig`` family fields of a checked HF config (``check_fields``)."""
    return dict(family=family, **FAMILIES[family].read(hf))


def hf_family_fields(llm: Any) -> dict[str, Any]:
    """The HF text-config fields that make transformers compute what ``llm`` (an ``LLMConfig``) computes; raises
    ``ConfigError`` for a combination the family's HF class cannot express."""
    written = FAMILIES[llm.family].write(llm)
    if written is None:
        raise ConfigError(
            f"HF {llm.family} cannot express qkv_bias={llm.qkv_bias}, o_bias={llm.o_bias}, mlp_bias={llm.mlp_bias}, "
            f"sliding_window={llm.sliding_window}"
        )
    return dict(model_type=llm.family, **written)
