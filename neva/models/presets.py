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
    # The tiny tower as Gemma 3's SigLIP: its features after the post-LayerNorm (last_hidden_state), bilinear resize
    # (Gemma3ImageProcessor); a 4 × 4 patch grid the gemma3 projector pools to 2 × 2 tokens.
    "tiny_gemma3": dict(
        kind="siglip",
        image_size=32,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
        vision_select_layer=-1,
        feature_norm=True,
        image_resample="bilinear",
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
    # The tiny Qwen3-VL tower as Qwen3.5's: no DeepStack features.
    "tiny_qwen3_5": dict(
        kind="qwen3_vl",
        image_size=64,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=16,
    ),
    # Qwen3.5's tower (transformers 5.25 Qwen3_5VisionConfig defaults, the class documented with Qwen/Qwen3.5-27B and
    # Qwen3.5-35B-A3B: depth 27, hidden 1152, intermediate 4304, 16 heads, 16 px patches merged 2 x 2, a 48 x 48
    # position table; Qwen3-VL's tower without DeepStack); image_size: the FLOP model's nominal image (448 px).
    "qwen3_5": dict(
        kind="qwen3_vl",
        image_size=448,
        patch_size=16,
        hidden_size=1152,
        intermediate_size=4304,
        num_layers=27,
        num_heads=16,
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=2304,
    ),
    # The tiny tower as GLM-4.1V's (neva/families/glm4v.py): 8 px patches merged 2 × 2, a 4 × 4 learned position table
    # (32 px / 8) resampled to each image, RMSNorm blocks without q / k / v bias, a SwiGLU MLP as wide as the tiny
    # decoder (GLM builds it out_hidden_size wide).
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
    # The tiny tower as Pixtral (Mistral 3): 8 px patches merged 2 × 2 by its projector, RMSNorm + bias-free SwiGLU
    # blocks, 2-D rotary; each image at its own size up to a 64 px longest edge (the synthetic 32 px image: 4 × 4
    # patches, 2 rows of 2 [IMG] and a break / end each, 6 decoder positions).
    "tiny_pixtral": dict(
        kind="pixtral",
        image_size=64,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        hidden_act="silu",
        temporal_patch_size=1,
    ),
    # Mistral Small 3.1's Pixtral tower (mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json vision_config: 24
    # layers of width 1024, intermediate 4096, 16 heads, 14 px patches, silu, image_size 1540: the processor's longest
    # edge, preprocessor_config.json; the projector merges 2 × 2 patches: 55 × 55 decoder tokens at most).
    "pixtral_1540": dict(
        kind="pixtral",
        image_size=1540,
        patch_size=14,
        hidden_size=1024,
        intermediate_size=4096,
        num_layers=24,
        num_heads=16,
        hidden_act="silu",
        temporal_patch_size=1,
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
    # google/gemma-3-4b-it's tower (config.json vision_config: SigLIP so400m/14 at 896 px, 64 × 64 patches): its
    # features after the post-LayerNorm, bilinear resize (its preprocessor_config.json resample 2); the gemma3
    # projector pools them to 16 × 16 = 256 tokens.
    "siglip_so400m_896": dict(
        kind="siglip",
        image_size=896,
        patch_size=14,
        hidden_size=1152,
        intermediate_size=4304,
        num_layers=27,
        num_heads=16,
        layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
        vision_select_layer=-1,
        feature_norm=True,
        image_resample="bilinear",
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
    # The tiny decoder as Gemma 3's (neva/families/gemma3.py): sliding (window 16, RoPE base 1e4) and global
    # (base 1e6) layers alternating, q / k norms, an attention scale of its own, untied (a pipeline can split it;
    # Gemma 3 ties its embeddings, which PP refuses).
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
    # The tiny decoder as Llama 4's (neva/families/llama4.py): chunked attention (16-token chunks) with RoPE and
    # weightless q / k norms in layers 0-2, a global NoPE layer 3 with query temperature tuning (floor_scale 16, so
    # that it acts at the tiny lengths; Llama 4's is 8192), Llama 3-scaled RoPE; dense layers 0 and 2 (width 352),
    # MoE layers 1 and 3: 4 experts of width 176, top-1 sigmoid scores on the experts' inputs, a shared expert of 176.
    "tiny_llama4": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=176,
        dense_intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_seq_len=512,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        family="llama4_text",
        layer_types=["chunked_attention"] * 3 + ["full_attention"],
        attention_chunk_size=16,
        nope_layers=[3],
        qk_l2_norm=True,
        attn_temperature_floor_scale=16,
        attn_temperature_scale=0.1,
        num_moe_experts=4,
        moe_router_topk=1,
        moe_layer_freq=[0, 1, 0, 1],
        moe_shared_expert_intermediate_size=176,
        moe_router_score_function="sigmoid",
        moe_apply_probs_on_input=True,
    ),
    # The tiny Qwen3 decoder as Qwen3.5's hybrid: Gated DeltaNet in layers 0-2 (2 query / key heads of 32 serving 4
    # value heads of 32, 4 conv taps), gated attention with RoPE on a quarter of each head in layer 3, (1 + w) norms.
    "tiny_qwen3_5": dict(
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
        family="qwen3_5",
        qk_norm=True,
        attention_output_gate=True,
        rotary_percent=0.25,
        layernorm_zero_centered_gamma=True,
        linear_attention=dict(
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            conv_kernel_dim=4,
            key_head_dim=32,
            value_head_dim=32,
            num_key_heads=2,
            num_value_heads=4,
        ),
    ),
    # Qwen/Qwen3.5-35B-A3B's decoder (transformers 5.25 Qwen3_5MoeTextConfig defaults, documented as that checkpoint):
    # 40 layers of width 2048, Gated DeltaNet in three of every four (16 key heads serving 32 value heads of 128, 4
    # conv taps), gated attention in the fourth (16 heads of 256, 2 KV heads, RoPE on a quarter: M-RoPE [11, 11, 10]
    # interleaved), 256 experts of width 512 (8 per token) and a gated shared expert of 512 in every block.
    "qwen3_5_35b_a3b": dict(
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=512,
        num_layers=40,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        max_seq_len=32768,
        rms_norm_eps=1e-6,
        family="qwen3_5_moe",
        qk_norm=True,
        attention_output_gate=True,
        rotary_percent=0.25,
        layernorm_zero_centered_gamma=True,
        mrope_section=[11, 11, 10],
        mrope_interleaved=True,
        num_moe_experts=256,
        moe_router_topk=8,
        moe_shared_expert_intermediate_size=512,
        moe_shared_expert_gate=True,
        linear_attention=dict(
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
            conv_kernel_dim=4,
            key_head_dim=128,
            value_head_dim=128,
            num_key_heads=16,
            num_value_heads=32,
        ),
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
    # Mistral Small 3.1's decoder (mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json text_config: 40 layers of
    # width 5120, intermediate 32768, 32 heads of 128, 8 KV heads, rope_theta 1e9, rms_norm_eps 1e-5, no sliding
    # window, vocabulary 131072, untied head).
    "mistral_small_3_1_24b": dict(
        vocab_size=131072,
        hidden_size=5120,
        intermediate_size=32768,
        num_layers=40,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_seq_len=131072,
        rope_theta=1e9,
        rms_norm_eps=1e-5,
        family="mistral",
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
        merger = merger_fields(vision_cfg, llm_cfg)
        projector = ProjectorConfig(
            type=projector_type, input_size=vision_cfg.feature_size, output_size=llm_cfg.hidden_size, **merger
        )
    token = llm_cfg.vocab_size - 1 if image_token_id is None else image_token_id
    return NevaConfig(llm=llm_cfg, vision=vision_cfg, projector=projector, image_token_id=token)
