"""Which HF decoder configs neva reads, field by field (each decoder family's rules: its ``DecoderSpec.fields``,
``neva.families``): every field is read, known not to change the computation, or refused naming the field and its
value. A family named in ``NOT_YET`` is refused with its reason.
"""

from __future__ import annotations

from typing import Any

from neva.families import DECODERS
from neva.families.hf_fields import CONFIG_BOOKKEEPING, Needs
from neva.typed import ConfigError

__all__ = ["CONFIG_BOOKKEEPING", "check_fields", "family_fields", "hf_family_fields"]

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
    if family not in DECODERS:
        raise ConfigError(f"{where}: model_type {family!r} is not a supported decoder family ({sorted(DECODERS)})")
    table, problems = DECODERS[family].fields, []
    for name, value in hf.items():
        rule = table.get(name)
        if rule is None:
            problems.append(f"{name}={value!r} (unknown to neva: it may change the computation)")
        elif isinstance(rule, Needs) and value not in rule.values:
            problems.append(f"{name}={value!r} ({rule.why})")
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        problems.append(f"layer_types={layer_types!r} (only full_attention layers are implemented)")
    if problems:
        raise ConfigError(f"{where} ({family}): refused field(s): " + "; ".join(problems))
    return family


def family_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The ``LLMConfig`` family fields of a checked HF config (``check_fields``)."""
    return dict(family=family, **DECODERS[family].read(hf))


def hf_family_fields(llm: Any) -> dict[str, Any]:
    """The HF text-config fields that make transformers compute what ``llm`` (an ``LLMConfig``) computes; raises
    ``ConfigError`` for a combination the family's HF class cannot express."""
    written = DECODERS[llm.family].write(llm)
    if written is None:
        raise ConfigError(
            f"HF {llm.family} cannot express qkv_bias={llm.qkv_bias}, o_bias={llm.o_bias}, mlp_bias={llm.mlp_bias}, "
            f"sliding_window={llm.sliding_window}"
        )
    return dict(model_type=llm.family, **written)
