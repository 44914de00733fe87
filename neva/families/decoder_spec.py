"""A decoder family (``LLMConfig.family``, the HF ``model_type`` an export writes): its HF config rules and how they
become ``LLMConfig`` fields, and what LLaVA's own code calls it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DecoderTraits:
    """What a decoder family implies beyond ``LLMConfig``'s fields (Llama's: the defaults; ``neva.models.decoder_traits``
    applies them)."""

    norm_offset: float = 0.0  # RMSNorm scales by (offset + w)
    sandwich_norms: bool = False  # post-attention and post-feed-forward norms before the residual adds
    scaled_embeddings: bool = False  # token embeddings × √hidden
    mlp_act: str = "silu"  # the gated feed-forward's activation
    bidirectional_images: bool = False  # an image's tokens attend to one another both ways


@dataclass(frozen=True)
class DecoderSpec:
    """One decoder family.

    Attributes:
        name: ``LLMConfig.family`` and the HF ``model_type`` of its text config.
        fields: every HF config field's rule (``neva.families.hf_fields``); None: its HF config is read only by its
            family's own interop (a decoder that comes only inside its multimodal class).
        read: the ``LLMConfig`` fields of a checked HF config.
        write: the HF fields an export writes for an ``LLMConfig`` (None: the HF class cannot express it).
        moe: its feed-forward is a mixture of experts (``num_moe_experts`` required).
        causal_lm: the transformers class of the bare decoder (a LLaVA-original export's ``--llm`` side).
        llava: LLaVA's own model type and class for it (``llava_llama``, ...), None where LLaVA has none.
        linear_attention: its ``layer_types`` may name linear-attention layers (a hybrid decoder: Qwen3.5).
        traits: what the family implies beyond ``LLMConfig``'s fields.
        interop: the whole-model HF interop of a model with this decoder where the decoder fixes the HF class
            (``neva.checkpoint``; Gemma 3's), else None: the tower family's decides.
        template: the family's own conversation template class where the decoder brings one
            (``neva.data.templates``; Gemma 3's), as ``TowerSpec.template``.
        presets: the family's named decoder shapes (``model.mm_cfg.llm.preset``), each a dict of ``LLMConfig``
            fields of this family, as plain data; ``neva.models.presets.LLM_PRESETS`` gathers them with the generic
            ones (as ``TowerSpec.presets``).
        check: the family's own rules on an ``LLMConfig`` (raises ``ValueError``).
    """

    name: str
    fields: dict[str, Any] | None
    read: Callable[[dict[str, Any]], dict[str, Any]] | None
    write: Callable[[Any], dict[str, Any] | None] | None
    moe: bool = False
    causal_lm: str | None = None
    llava: tuple[str, str] | None = None
    linear_attention: bool = False
    traits: DecoderTraits = DecoderTraits()
    interop: str | None = None
    template: str | None = None
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    check: Callable[[Any], None] | None = None

    def parts(self) -> dict[str, str]:
        """The code parts this spec names, by field (what ``tests/test_family_specs.py`` checks)."""
        return {name: path for name, path in (("interop", self.interop), ("template", self.template)) if path}
