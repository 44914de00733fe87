"""Published model shapes (Llama-2 7B/13B/70B, Llama-3-8B, Mistral-7B v0.1, Qwen2-7B, CLIP ViT-L/14 at 224 and 336 px,
SigLIP so400m/14 at 384 px) and the tiny embedded default (CLIP or SigLIP tower; Llama, and a Qwen2 twin: q/k/v
biases, tied embeddings)."""

from __future__ import annotations

from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig, merger_fields

VISION_PRESETS: dict[str, dict] = {
    # 32 px images in 8 px patches: 16 image tokens, fast enough to train on a laptop CPU.
    "tiny": dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4),
    "clip_vit_l14_224": dict(image_size=224, patch_size=14),
    "clip_vit_l14_336": dict(image_size=336, patch_size=14),
    # The tiny tower as SigLIP (no class token: 16 image tokens, 4 with mlp_downsample).
    "tiny_siglip": dict(
        kind="siglip",
        image_size=32,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
    ),
    # The tiny tower as Qwen2.5-VL's native-resolution ViT: 8 px patches merged 2 × 2, RMSNorm + SwiGLU blocks, block 0
    # in 32 px windows (2 × 2 merged tokens), block 1 attending the whole image. The synthetic set draws its images at
    # image_size (64 px: 8 × 8 patches, 16 decoder positions, as the tiny CLIP's 16); real images keep their own size.
    "tiny_qwen2_5_vl": dict(
        kind="qwen2_5_vl",
        image_size=64,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        hidden_act="silu",
        window_size=32,
        fullatt_block_indexes=[1],
    ),
    # The tiny tower as Qwen3-VL's: LayerNorm + tanh-GELU blocks, a learned 4 × 4 position table resampled to each
    # image's grid, and both blocks' outputs as DeepStack features (joining decoder layers 0 and 1).
    "tiny_qwen3_vl": dict(
        kind="qwen3_vl",
        image_size=64,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    ),
    # The tiny tower as InternViT (InternVL 3 / 3.5): 32 px tiles in 8 px patches (4 × 4), a class token, layer scale,
    # LayerNorm blocks with biased q / k / v; the pixel shuffle makes 4 decoder positions per tile.
    "tiny_internvl": dict(
        kind="internvl",
        image_size=32,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        hidden_act="gelu",
    ),
    # OpenGVLab/InternVL3-8B-hf's tower, InternViT-300M-448px-V2.5 (config.json vision_config: 24 layers, width 1024,
    # intermediate 4096, 16 heads, 448 px tiles in 14 px patches, layer_norm, attention_bias true, no qk norm).
    "internvit_300m_448": dict(
        kind="internvl",
        image_size=448,
        patch_size=14,
        hidden_size=1024,
        intermediate_size=4096,
        num_layers=24,
        num_heads=16,
        hidden_act="gelu",
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct's tower (config.json vision_config: depth 32, hidden_size 1280, intermediate_size 3420,
    # num_heads 16, patch_size 14, window_size 112, fullatt_block_indexes [7, 15, 23, 31], silu); image_size is only
    # the nominal image of the FLOP model's per-patch attention estimate (448 px: 32 × 32 patches, 256 positions).
    "qwen2_5_vl_7b": dict(
        kind="qwen2_5_vl",
        image_size=448,
        patch_size=14,
        hidden_size=1280,
        intermediate_size=3420,
        num_layers=32,
        num_heads=16,
        hidden_act="silu",
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
    # google/siglip-so400m-patch14-384 (config.json vision_config): 27×27 = 729 patches, width 1152, 27 layers.
    "siglip_so400m_384": dict(
        kind="siglip",
        image_size=384,
        patch_size=14,
        hidden_size=1152,
        intermediate_size=4304,
        num_layers=27,
        num_heads=16,
        layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
    ),
}

LLM_PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=512,
    ),
    # Decoder families (shapes: /work/shared/REFERENCES.md "Other model families", from the released config.json).
    "tiny_qwen2": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=512,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        family="qwen2",
        qkv_bias=True,
        tie_word_embeddings=True,
    ),
    # The tiny decoder as Qwen3's: q / k RMSNorms per head, no biases, untied (a pipeline can split it).
    "tiny_qwen3": dict(
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
        family="qwen3",
        qk_norm=True,
    ),
    "qwen2_7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        max_seq_len=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        family="qwen2",
        qkv_bias=True,
    ),
    "llama3_8b": dict(
        vocab_size=128256,
        intermediate_size=14336,
        num_kv_heads=8,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "mistral_7b": dict(
        intermediate_size=14336,
        num_kv_heads=8,
        max_seq_len=32768,
        family="mistral",
        sliding_window=4096,
    ),
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
    "llama2_7b": dict(),
    "llama2_13b": dict(hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40),
    "llama2_70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
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
        merger = merger_fields(vision_cfg)
        projector = ProjectorConfig(
            type=projector_type, input_size=vision_cfg.feature_size, output_size=llm_cfg.hidden_size, **merger
        )
    token = llm_cfg.vocab_size - 1 if image_token_id is None else image_token_id
    return NevaConfig(llm=llm_cfg, vision=vision_cfg, projector=projector, image_token_id=token)
