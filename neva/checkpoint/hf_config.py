"""Config translation between HF (``LlamaConfig``, ``CLIPVisionConfig``, ``LlavaConfig`` dicts) and neva configs."""

from __future__ import annotations

from typing import Any

from neva.checkpoint.hf_moe import moe_fields_from_hf, moe_text_config
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig


def llm_config_from_hf(hf: dict[str, Any]) -> LLMConfig:
    """LLMConfig from an HF Llama/Mistral config dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("Llama checkpoints with attention/MLP biases are not supported")
    return LLMConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rope_theta=float(theta),
        rope_scaling=dict(scaling) if scaling else None,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **moe_fields_from_hf(hf),
    )


def vision_config_from_hf(
    hf: dict[str, Any], select_layer: int | list[int] = -2, select: str = "patch"
) -> VisionConfig:
    """VisionConfig from an HF CLIP vision config dict (or a full CLIPConfig dict: its ``vision_config`` is used)."""
    hf = hf.get("vision_config", hf)
    return VisionConfig(
        image_size=hf.get("image_size", 224),
        patch_size=hf.get("patch_size", 32),
        num_channels=hf.get("num_channels", 3),
        hidden_size=hf.get("hidden_size", 768),
        intermediate_size=hf.get("intermediate_size", 3072),
        num_layers=hf.get("num_hidden_layers", 12),
        num_heads=hf.get("num_attention_heads", 12),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
        hidden_act=hf.get("hidden_act", "quick_gelu"),
        vision_select_layer=select_layer,
        vision_select_feature=select,
    )


def neva_config_from_llava(hf: dict[str, Any]) -> NevaConfig:
    """NevaConfig from a ``LlavaConfig`` dict (llava-hf ``config.json``)."""
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError(f"unsupported projector_hidden_act {hf['projector_hidden_act']!r} (only gelu)")
    strategy = hf.get("vision_feature_select_strategy", "default")
    vision = vision_config_from_hf(
        hf["vision_config"],
        select_layer=hf.get("vision_feature_layer", -2),
        select={"default": "patch", "full": "cls_patch"}[strategy],
    )
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    llm = llm_config_from_hf(text)
    projector = ProjectorConfig(
        type="mlp2x_gelu",
        input_size=vision.feature_size,
        output_size=llm.hidden_size,
        bias=hf.get("multimodal_projector_bias", True),
    )
    token = hf.get("image_token_index", hf.get("image_token_id", 32000))
    return NevaConfig(llm=llm, vision=vision, projector=projector, image_token_id=token)


def llava_config_dict(cfg: NevaConfig, pad_token_id: int | None = None) -> dict[str, Any]:
    """``LlavaConfig`` kwargs (vision_config/text_config as dicts) for a NevaConfig; only ``mlp2x_gelu`` exports."""
    if cfg.vision is None or cfg.projector is None or cfg.projector.type != "mlp2x_gelu":
        raise ValueError("HF LlavaForConditionalGeneration needs a vision tower and an mlp2x_gelu projector")
    v, t = cfg.vision, cfg.llm
    rope = {"rope_type": "default", "rope_theta": t.rope_theta, **(t.rope_scaling or {})}
    select = v.vision_select_layer
    return dict(
        vision_config=dict(
            model_type="clip_vision_model",
            image_size=v.image_size,
            patch_size=v.patch_size,
            num_channels=v.num_channels,
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            num_hidden_layers=v.num_layers,
            num_attention_heads=v.num_heads,
            layer_norm_eps=v.layer_norm_eps,
            hidden_act=v.hidden_act,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_layers,
            num_attention_heads=t.num_heads,
            num_key_value_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            rms_norm_eps=t.rms_norm_eps,
            max_position_embeddings=t.max_seq_len,
            rope_parameters=rope,
            tie_word_embeddings=t.tie_word_embeddings,
            pad_token_id=pad_token_id,
        )
        | moe_text_config(t),
        image_token_index=cfg.image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default" if v.vision_select_feature == "patch" else "full",
        vision_feature_layer=list(select) if isinstance(select, (list, tuple)) else select,
        image_seq_length=v.num_image_tokens,
        multimodal_projector_bias=cfg.projector.bias,
        tie_word_embeddings=t.tie_word_embeddings,
    )
