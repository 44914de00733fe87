"""Mixtral: Mistral's attention with a sparse MoE feed-forward (neva/models/moe.py)."""

from __future__ import annotations

from typing import Any

from neva.families.decoder_spec import DecoderSpec
from neva.families.hf_fields import COMMON, INERT, READ, Needs


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


# Mixtral's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_MIXTRAL_PRESETS: dict[str, dict] = {
    # The tiny decoder with Mixtral's MoE feed-forward (4 experts, top-2; NeMo's Mixtral aux-loss coefficient).
    "tiny_moe": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=176,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=512,
        family="mixtral",
        num_moe_experts=4,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json; moe_aux_loss_coeff 0.01 as NeMo's neva_mixtral_config.yaml
    "mixtral_8x7b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=1e6,
        max_seq_len=32768,
        family="mixtral",
        num_moe_experts=8,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
    ),
}

MIXTRAL = DecoderSpec(
    "mixtral",
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
    moe=True,
    presets=_MIXTRAL_PRESETS,
)
