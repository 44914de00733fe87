"""A decoder family (``LLMConfig.family``, the HF ``model_type`` an export writes): its HF config rules and how they
become ``LLMConfig`` fields, and what LLaVA's own code calls it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderSpec:
    """One decoder family.

    Attributes:
        name: ``LLMConfig.family`` and the HF ``model_type`` of its text config.
        fields: every HF config field's rule (``neva.families.hf_fields``).
        read: the ``LLMConfig`` fields of a checked HF config.
        write: the HF fields an export writes for an ``LLMConfig`` (None: the HF class cannot express it).
        moe: its feed-forward is a mixture of experts (``num_moe_experts`` required).
        causal_lm: the transformers class of the bare decoder (a LLaVA-original export's ``--llm`` side).
        llava: LLaVA's own model type and class for it (``llava_llama``, ...), None where LLaVA has none.
    """

    name: str
    fields: dict[str, Any]
    read: Callable[[dict[str, Any]], dict[str, Any]]
    write: Callable[[Any], dict[str, Any] | None]
    moe: bool = False
    causal_lm: str | None = None
    llava: tuple[str, str] | None = None
