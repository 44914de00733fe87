"""Gemma 3 (HF ``Gemma3ForConditionalGeneration``): a SigLIP tower read after its post-LayerNorm at 896 px, pooled
to 256 tokens by its own projector (average pool, RMSNorm, linear: ``neva.models.projector_gemma3``), and a decoder
of interleaved sliding / global layers with their own RoPE bases, q / k norms, four norms per block, embeddings scaled
by √hidden and bidirectional attention inside each image (its traits). The decoder comes only inside its multimodal
class, so the family's own interop (``neva.checkpoint.hf_gemma3``) reads and writes its HF config.
"""

from __future__ import annotations

import math
from typing import Any

from neva.families.decoder_spec import DecoderSpec, DecoderTraits


def _check(llm: Any) -> None:
    if not llm.qk_norm:
        raise ValueError("a gemma3 decoder has per-head q / k norms: qk_norm must be true")


# Gemma 3's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_GEMMA3_PRESETS: dict[str, dict] = {
    # The tiny decoder as Gemma 3's: sliding (window 16, RoPE base 1e4) and global (base 1e6) layers alternating,
    # q / k norms, an attention scale of its own, untied (a pipeline can split it; Gemma 3 ties its embeddings, which
    # PP refuses).
    "tiny_gemma3": dict(
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
        family="gemma3",
        qk_norm=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_local_theta=1e4,
        query_pre_attn_scalar=48,
    ),
    # google/gemma-3-4b-it's decoder (config.json text_config and transformers' Gemma3TextConfig defaults): every 6th
    # of 34 layers global (RoPE 1e6, linear scaling 8), the others sliding over 1024 tokens (RoPE 1e4), tied.
    "gemma3_4b": dict(
        vocab_size=262208,
        hidden_size=2560,
        intermediate_size=10240,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        head_dim=256,
        max_seq_len=131072,
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        family="gemma3",
        qk_norm=True,
        sliding_window=1024,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)],
        rope_local_theta=1e4,
        query_pre_attn_scalar=256,
    ),
}

GEMMA3 = DecoderSpec(
    "gemma3",
    fields=None,
    read=None,
    write=None,
    traits=DecoderTraits(
        norm_offset=1.0,
        sandwich_norms=True,
        scaled_embeddings=True,
        mlp_act="gelu_pytorch_tanh",
        bidirectional_images=True,
    ),
    interop="neva.checkpoint.hf_gemma3:GEMMA3_INTEROP",
    template="neva.data.templates.gemma3:Gemma3Template",
    check=_check,
    presets=_GEMMA3_PRESETS,
)


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
