"""Gemma 3's facts as configuration: the decoder traits its family brings, and the checks of its fields.

A Gemma 3 decoder (HF ``Gemma3TextModel``) is neva's one decoder with these traits, which the family implies rather
than configures (every released Gemma 3 has them all):

- RMSNorms scale by ``1 + w`` (weights stored centred on 0, initialised to 0), computed in fp32 and cast after;
- four norms per block: before and after attention, before and after the feed-forward (``post_attention_norm``,
  ``post_ffn_norm``: the outputs are normalised before each residual add);
- token embeddings scaled by √hidden (in the embedding's dtype, as HF rounds it), image features not;
- a gated tanh-GELU feed-forward (``gelu_pytorch_tanh`` where Llama has SiLU);
- per-head q / k norms (``qk_norm``);
- each image's tokens attend to one another in both directions inside the causal decoder (HF's ``token_type_ids``
  blocks): a rule of the attention plan (``neva.models.attention``), not a dense mask.

Its configured facts are ``LLMConfig`` fields: ``layer_types`` (interleaved sliding-window / global layers),
``rope_local_theta`` (the sliding layers' RoPE base), ``query_pre_attn_scalar`` (the attention scale) and
``final_logit_softcapping``. Its projector (``ProjectorConfig.type`` ``gemma3``) is ``neva.models.projector_gemma3``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class DecoderTraits:
    """What a decoder family implies beyond ``LLMConfig``'s fields (Llama's: the defaults)."""

    norm_offset: float = 0.0  # RMSNorm scales by (offset + w)
    sandwich_norms: bool = False  # post-attention and post-feed-forward norms before the residual adds
    scaled_embeddings: bool = False  # token embeddings × √hidden
    mlp_act: str = "silu"  # the gated feed-forward's activation
    bidirectional_images: bool = False  # an image's tokens attend to one another both ways


FAMILY_TRAITS = {
    "gemma3": DecoderTraits(
        norm_offset=1.0, sandwich_norms=True, scaled_embeddings=True, mlp_act="gelu_pytorch_tanh",
        bidirectional_images=True,
    ),
}  # fmt: skip
DEFAULT_TRAITS = DecoderTraits()


def traits(llm: Any) -> DecoderTraits:
    """The traits of an ``LLMConfig``'s family."""
    return FAMILY_TRAITS.get(llm.family, DEFAULT_TRAITS)


def embed_scale(llm: Any) -> float | None:
    """The factor token embeddings are multiplied by (None: none)."""
    return math.sqrt(llm.hidden_size) if traits(llm).scaled_embeddings else None


def check_gemma_fields(llm: Any) -> None:
    """``LLMConfig``'s layer-type, local RoPE, attention-scale and softcap fields, and what the gemma3 family needs.

    Raises:
        ValueError: a layer type neva has no rule for, a list of the wrong length, a local RoPE base without
            sliding layers, a non-positive scale or softcap, a gemma3 decoder without q / k norms.
    """
    if llm.layer_types is not None:
        llm.layer_types = list(llm.layer_types)
        bad = sorted(set(llm.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types {bad}: each must be one of {', '.join(LAYER_TYPES)}")
        if len(llm.layer_types) != llm.num_layers:
            raise ValueError(f"layer_types has {len(llm.layer_types)} entries for {llm.num_layers} layers")
        if "sliding_attention" in llm.layer_types and llm.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
    if llm.rope_local_theta is not None and "sliding_attention" not in (llm.layer_types or ()):
        raise ValueError("rope_local_theta is the RoPE base of sliding_attention layers: layer_types has none")
    for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
        value = getattr(llm, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive or None, got {value}")
    if llm.family == "gemma3" and not llm.qk_norm:
        raise ValueError("a gemma3 decoder has per-head q / k norms: qk_norm must be true")


def sliding(llm: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` attends within ``sliding_window`` (every layer does without ``layer_types``)."""
    if llm.sliding_window is None:
        return False
    return llm.layer_types is None or llm.layer_types[layer] == "sliding_attention"


def check_gemma3_projector(tokens_per_image: int | None, grid: int) -> None:
    """Gemma 3's projector average-pools the ``grid``² patch grid to ``tokens_per_image`` tokens (a square) with one
    kernel that must tile the grid exactly as HF's ``AvgPool2d`` (kernel ``grid // side``) does.

    Raises:
        ValueError: no count, a count that is not a square, or a grid the kernel does not pool to that count.
    """
    if tokens_per_image is None:
        raise ValueError("projector gemma3 needs tokens_per_image (HF mm_tokens_per_image)")
    side = math.isqrt(tokens_per_image)
    if side * side != tokens_per_image or side == 0:
        raise ValueError(f"projector tokens_per_image {tokens_per_image} is not a positive square")
    kernel = grid // side
    if kernel == 0 or grid // kernel != side:
        raise ValueError(
            f"projector gemma3 pools a {grid}×{grid} patch grid to {side}×{side}: the kernel {grid} // {side} does not"
        )


def gemma3_tokens_per_image(grid: int) -> int:
    """The tokens a new gemma3 projector (built from run settings, not imported) pools a ``grid``² patch grid to:
    Gemma 3's 16 × 16 where the grid is a multiple of 16 (896 px / 14: kernel 4), else one token per 2 × 2 patches
    (the tiny towers), else no pooling."""
    if grid % 16 == 0:
        return 256
    return (grid // 2) ** 2 if grid % 2 == 0 else grid * grid
