"""Every named model shape: ``VISION_PRESETS`` (``model.mm_cfg.vision_encoder.preset``) and ``LLM_PRESETS``
(``model.mm_cfg.llm.preset``).

A family's shapes are its spec's ``presets`` (``TowerSpec.presets`` of its tower kind, ``DecoderSpec.presets`` of its
decoder family, in ``neva/families/<family>.py``: published shapes from the released config.json, and a tiny one per
family for the tests); this module keeps only the tiny embedded default that owns no family (a CLIP tower and a Llama
decoder, ``build_config``'s default) and gathers the rest through the registry, so that a new family's presets are
its own file's (docs/ARCHITECTURE.md, "Adding a family")."""

from __future__ import annotations

from collections.abc import Iterable

from neva.families import DECODERS, TOWERS
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig, merger_fields

GENERIC_VISION_PRESETS: dict[str, dict] = {
    # 32 px images in 8 px patches: 16 image tokens, fast enough to train on a laptop CPU.
    "tiny": dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4),
}
"""The tower shapes no family owns: the tiny default (a CLIP tower, ``VisionConfig``'s default kind)."""

GENERIC_LLM_PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=512,
    ),
}
"""The decoder shapes no family owns: the tiny default (a Llama decoder, ``LLMConfig``'s default family)."""


def gather_presets(generic: dict[str, dict], owned: Iterable[tuple[str, dict[str, dict]]]) -> dict[str, dict]:
    """The generic presets, then each owner's (``(owner, presets)``, an owner named as an error names it).

    Raises:
        TypeError: two presets with one name (configs and checkpoints name a preset, so a name is one shape).
    """
    found = dict(generic)
    owner_of = dict.fromkeys(generic, "neva.models.presets")
    for owner, presets in owned:
        for name, fields in presets.items():
            if name in found:
                raise TypeError(f"two presets are called {name!r}: {owner_of[name]}'s and {owner}'s")
            found[name] = fields
            owner_of[name] = owner
    return found


VISION_PRESETS: dict[str, dict] = gather_presets(
    GENERIC_VISION_PRESETS, ((f"tower spec {kind!r}", spec.presets) for kind, spec in TOWERS.items())
)
"""Preset name → ``VisionConfig`` fields: the generic ones and every tower family's (``TowerSpec.presets``)."""

LLM_PRESETS: dict[str, dict] = gather_presets(
    GENERIC_LLM_PRESETS, ((f"decoder spec {name!r}", spec.presets) for name, spec in DECODERS.items())
)
"""Preset name → ``LLMConfig`` fields: the generic ones and every decoder family's (``DecoderSpec.presets``)."""


def build_config(
    llm: str | dict = "tiny",
    vision: str | dict | None = "tiny",
    projector_type: str = "mlp2x_gelu",
    image_token_id: int | None = None,
    **llm_overrides,
) -> NevaConfig:
    """A NevaConfig from preset names (or field dicts); the image token defaults to the last vocab id."""
    llm_cfg = LLMConfig(**{**(LLM_PRESETS[llm] if isinstance(llm, str) else llm), **llm_overrides})
    vision_cfg = None
    projector = None
    if vision is not None:
        vision_cfg = VisionConfig(**(VISION_PRESETS[vision] if isinstance(vision, str) else vision))
        merger = merger_fields(vision_cfg, llm_cfg)
        projector = ProjectorConfig(
            type=projector_type, input_size=vision_cfg.feature_size, output_size=llm_cfg.hidden_size, **merger
        )
    token = llm_cfg.vocab_size - 1 if image_token_id is None else image_token_id
    return NevaConfig(llm=llm_cfg, vision=vision_cfg, projector=projector, image_token_id=token)
