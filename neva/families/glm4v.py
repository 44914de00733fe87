"""GLM-4.1V (HF ``Glm4vForConditionalGeneration``): a Qwen2-VL-like native-resolution tower (a biased Conv3d patch
embedding, an RMSNorm after it, 2-D rotary, a learned square position table resampled bicubically to each image's
grid, RMSNorm blocks with a bias-free SwiGLU MLP as wide as the decoder, a post-RMSNorm), a downsampling merger (a
Conv2d over each merge block, then Linear, LayerNorm, GELU and a SwiGLU: ``neva.models.projector_glm4v``) and a GLM-4
decoder (``glm4v_text``: sandwich norms, biased q / k / v, M-RoPE over a partial rotary in interleaved pairs, which
the interop turns into neva's half-split layout by permuting q / k rows).

Its statistics are OpenAI CLIP's (``Glm4vImageProcessor``), its norms' epsilon 1e-5 (``rms_norm_eps``), and its
merger reads the last block. Its image processor resizes as Qwen's ``smart_resize`` but counts the pixel budget over
the ``temporal_patch_size`` frames an image is repeated to, and first scales a side shorter than one merged token up
(``neva.data.glm4v_images``); the default budget is ``Glm4vImageProcessor``'s ``size`` (112·112, 28·28·15000). An
image's text is ``<|begin_of_image|>`` + its ``<|image|>`` tokens + ``<|end_of_image|>`` (the ``glm4v`` template).
Videos (frames with timestamp text between them) are not served yet: ``VideoRule.served`` is False.
"""

from __future__ import annotations

import math
from typing import Any

from neva.constants import CLIP_MEAN, CLIP_STD
from neva.families.decoder_spec import DecoderSpec, DecoderTraits
from neva.families.spec import MergerSpec, TowerSpec, VideoRule


def _check_tower(cfg: Any) -> None:
    if cfg.select_indices != [cfg.num_layers] or cfg.vision_select_feature != "patch":
        raise ValueError("a glm4v tower's merger reads its last block: vision_select_layer -1, feature patch")
    if (cfg.hidden_size // cfg.num_heads) % 4:
        raise ValueError(f"glm4v: head size {cfg.hidden_size // cfg.num_heads} must be a multiple of 4 (2-D rotary)")
    side = math.isqrt(cfg.num_position_embeddings)
    if side * side != cfg.num_position_embeddings:
        raise ValueError(f"glm4v num_position_embeddings {cfg.num_position_embeddings} is not a square")
    if cfg.fullatt_block_indexes or cfg.deepstack_visual_indexes:
        raise ValueError("a glm4v tower has no windows and no DeepStack blocks")
    if cfg.norm_type != "rms" or cfg.qk_norm:  # qkv_bias is read (HF attention_bias)
        raise ValueError("a glm4v tower's blocks are RMSNorm without q / k norms: norm_type rms, qk_norm false")


# GLM-4.1V's named tower shapes (model.mm_cfg.vision_encoder.preset), gathered by neva.models.presets.
_GLM4V_PRESETS: dict[str, dict] = {
    # The tiny tower as GLM-4.1V's: 8 px patches merged 2 × 2, a 4 × 4 learned position table (32 px / 8) resampled
    # to each image, RMSNorm blocks without q / k / v bias, a SwiGLU MLP as wide as the tiny decoder (GLM builds it
    # out_hidden_size wide).
    "tiny_glm4v": dict(
        kind="glm4v",
        image_size=32,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        hidden_act="silu",
        num_position_embeddings=16,
        norm_type="rms",
        qkv_bias=False,
    ),
    # GLM-4.1V-9B's tower (transformers 5.25 Glm4vVisionConfig, whose defaults are the GLM-4.1V-9B-Thinking
    # configuration: depth 24, hidden_size 1536, 12 heads, 336 px / 14 px patches (a 24 × 24 position table), silu, no
    # q / k / v bias; its MLP out_hidden_size = 4096 wide, the decoder's width).
    "glm4v_9b": dict(
        kind="glm4v",
        image_size=336,
        patch_size=14,
        hidden_size=1536,
        intermediate_size=4096,
        num_layers=24,
        num_heads=12,
        hidden_act="silu",
        num_position_embeddings=576,
        norm_type="rms",
        qkv_bias=False,
    ),
}

GLM4V = TowerSpec(
    kind="glm4v",
    tower="neva.models.vision_glm4v:Glm4vTower",
    front_end="neva.data.front_ends:native_images",
    interop="neva.checkpoint.hf_glm4v:GLM4V_INTEROP",
    fit="neva.data.glm4v_images:glm4v_resize",
    acts=("silu",),
    class_tokens=0,
    mean=CLIP_MEAN,
    std=CLIP_STD,
    eps=1e-5,
    select=-1,
    patch_grid=True,
    # Its own projector class: its LayerNorm sits after the merge and proj, not before them; its SwiGLU as wide as
    # the decoder's MLP, without biases; the downsampling Conv2d, then proj, its norm and the SwiGLU in FLOP order.
    merger=MergerSpec(
        "glm4v_merger",
        norm="layer",
        decoder_width=True,
        flop_steps=(("downsample", 0), ("proj", 1), ("norm", 2), ("gate_proj", 3), ("up_proj", 3), ("down_proj", 4)),
    ),
    projector="neva.models.projector_glm4v:Glm4vMerger",
    projector_plan="neva.parallel.glm4v_merger_plan:glm4v_merger_plan",
    video=VideoRule(per_frame=True, timed=False, served=False),
    pixels=(112 * 112, 28 * 28 * 15000),
    gated_mlp=True,
    block_options=True,
    template="neva.data.templates.glm4v:Glm4vTemplate",
    check=_check_tower,
    presets=_GLM4V_PRESETS,
)


def _check_decoder(llm: Any) -> None:
    if llm.mrope_section is None or llm.qk_norm or not llm.qkv_bias or llm.o_bias or llm.mlp_bias:
        raise ValueError(
            "a glm4v_text decoder has M-RoPE (mrope_section), biased q / k / v, no output or MLP bias, no q / k norms"
        )


# GLM-4.1V's named decoder shapes (model.mm_cfg.llm.preset), gathered by neva.models.presets.
_GLM4V_TEXT_PRESETS: dict[str, dict] = {
    # The tiny decoder as GLM-4.1V's (glm4v_text): four norms per layer, biased q / k / v, M-RoPE over the first half
    # of each 32-wide head (t, h, w driving 2, 3, 3 of its 8 rotary frequencies, GLM's [8, 12, 12] at head_dim 128),
    # untied (a pipeline can split it).
    "tiny_glm4v_text": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=512,
        rms_norm_eps=1e-5,
        family="glm4v_text",
        qkv_bias=True,
        mrope_section=[2, 3, 3],
        rotary_percent=0.5,
    ),
    # GLM-4.1V-9B's decoder (GLM-4-9B-0414's shapes: transformers 5.25 Glm4vTextConfig defaults, the
    # GLM-4.1V-9B-Thinking configuration: 40 layers of width 4096, MLP 13696, 32 heads, 2 kv heads, vocabulary 151552;
    # M-RoPE section [8, 12, 12], the Glm4vTextRotaryEmbedding default, which drives 32 frequencies: a partial rotary
    # over half of each 128-wide head), biased q / k / v, untied.
    "glm4v_9b_text": dict(
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=13696,
        num_layers=40,
        num_heads=32,
        num_kv_heads=2,
        max_seq_len=65536,
        rms_norm_eps=1e-5,
        family="glm4v_text",
        qkv_bias=True,
        mrope_section=[8, 12, 12],
        rotary_percent=0.5,
    ),
}

# GLM-4's decoder as GLM-4.1V's text model: it comes only inside its multimodal class, whose interop
# (neva.checkpoint.hf_glm4v) reads and writes its HF config.
GLM4V_TEXT = DecoderSpec(
    "glm4v_text",
    fields=None,
    read=None,
    write=None,
    traits=DecoderTraits(sandwich_norms=True),
    check=_check_decoder,
    presets=_GLM4V_TEXT_PRESETS,
)
