"""The registry of model families: one line per family (``docs/ARCHITECTURE.md``, "Adding a family").

Generic code asks ``tower_spec(kind)`` (or ``merger_spec(projector type)``) what a family is and does; the spec names
its parts, which the owning package resolves (``neva.families.spec``).
"""

from __future__ import annotations

from neva.families.clip import CLIP
from neva.families.decoder_spec import DecoderSpec
from neva.families.gemma3 import GEMMA3
from neva.families.glm4v import GLM4V, GLM4V_TEXT
from neva.families.internvl import INTERNVL
from neva.families.llama import LLAMA, MISTRAL
from neva.families.llama4 import LLAMA4
from neva.families.mixtral import MIXTRAL
from neva.families.pixtral import PIXTRAL
from neva.families.qwen import QWEN2, QWEN3, QWEN3_MOE
from neva.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from neva.families.qwen_vl import QWEN2_5_VL, QWEN2_VL, QWEN3_VL
from neva.families.siglip import SIGLIP
from neva.families.spec import MergerSpec, TowerSpec, VideoRule, part

TOWERS: dict[str, TowerSpec] = {
    spec.kind: spec for spec in (CLIP, SIGLIP, QWEN2_VL, QWEN2_5_VL, QWEN3_VL, INTERNVL, GLM4V, PIXTRAL)
}
"""Vision families, by ``VisionConfig.kind``."""

DECODERS: dict[str, DecoderSpec] = {
    spec.name: spec
    for spec in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE, GEMMA3, GLM4V_TEXT, LLAMA4)
}
"""Decoder families, by ``LLMConfig.family`` (the HF ``model_type`` of their text config)."""

MERGERS: dict[str, TowerSpec] = {spec.merger.projector: spec for spec in TOWERS.values() if spec.merger is not None}
"""A patch merger's projector type → the tower it follows."""

__all__ = [
    "DECODERS",
    "MERGERS",
    "TOWERS",
    "DecoderSpec",
    "MergerSpec",
    "TowerSpec",
    "VideoRule",
    "decoder_spec",
    "merger_spec",
    "part",
    "tower_spec",
]


def tower_spec(kind: str) -> TowerSpec:
    """The family of tower ``kind``.

    Raises:
        ValueError: a kind no family has, naming the known ones.
    """
    try:
        return TOWERS[kind]
    except KeyError:
        raise ValueError(f"vision kind must be one of {sorted(TOWERS)}, got {kind!r}") from None


def merger_spec(projector_type: str) -> TowerSpec | None:
    """The family whose patch merger ``projector_type`` is, or None for another projector."""
    return MERGERS.get(projector_type)


def decoder_spec(name: str) -> DecoderSpec:
    """The decoder family ``name``.

    Raises:
        ValueError: a family neva has no spec for, naming the known ones.
    """
    try:
        return DECODERS[name]
    except KeyError:
        raise ValueError(f"LLM family must be one of {sorted(DECODERS)}, got {name!r}") from None
