"""Config translation between HF (``LlamaConfig``, ``CLIPVisionConfig`` / ``SiglipVisionConfig``, ``LlavaConfig``
dicts) and neva configs."""

from __future__ import annotations

import warnings
from typing import Any

from neva.checkpoint.hf_families import check_fields, family_fields, hf_family_fields
from neva.checkpoint.hf_onevision import onevision_config_fields
from neva.checkpoint.hf_video import video_config_dict, video_from_hf
from neva.checkpoint.hf_wrappers import wrapper_named
from neva.families import TOWERS, tower_spec
from neva.models.anyres import AnyResConfig, parse_aspect_ratio, parse_grid_pinpoints
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig
from neva.typed import ConfigError


def llm_config_from_hf(hf: dict[str, Any], where: str = "LLM config") -> LLMConfig:
    """LLMConfig from an HF Llama / Mistral / Qwen2 config dict (transformers 4.x ``rope_scaling`` or 5.x
    ``rope_parameters``). Every field is honoured or refused (``hf_families``: ``ConfigError`` naming it)."""
    family = check_fields(hf, where)
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    fields = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        # MoE decoders without a dense width (Qwen3.5-MoE) take their experts' from the family's reading below
        intermediate_size=hf.get("intermediate_size", hf.get("moe_intermediate_size")),
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rope_theta=float(theta),
        rope_scaling=dict(scaling) if scaling else None,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    # A family's own reading wins (Qwen3-MoE: intermediate_size is each expert's, its moe_intermediate_size).
    return LLMConfig(**{**fields, **family_fields(hf, family)})


# HF vision ``model_type`` → the family of a llava-hf tower (``TowerSpec.hf_model_type``: its field defaults, its
# select strategies, the fields an export adds).
TOWER_MODEL_TYPES = {spec.hf_model_type: spec for spec in TOWERS.values() if spec.hf_model_type}


def tower_kind(hf: dict[str, Any]) -> str:
    """The neva tower kind of an HF vision config dict (a full CLIPConfig / SiglipConfig: its ``vision_config``).

    Raises:
        ConfigError: a ``model_type`` neva has no tower for, named with the supported ones.
    """
    hf = hf.get("vision_config", hf)
    model_type = hf.get("model_type")
    if model_type not in TOWER_MODEL_TYPES:
        why = (
            " (SigLIP2's NaFlex variable-resolution tower; fixed-resolution SigLIP2 checkpoints are siglip)"
            if (model_type == "siglip2_vision_model")
            else ""
        )
        raise ConfigError(
            f"vision config model_type={model_type!r}{why} is not a supported tower; supported: "
            + ", ".join(f"{k} ({v.kind})" for k, v in TOWER_MODEL_TYPES.items())
        )
    return TOWER_MODEL_TYPES[model_type].kind


def vision_config_from_hf(
    hf: dict[str, Any], select_layer: int | list[int] = -2, select: str = "patch"
) -> VisionConfig:
    """VisionConfig from an HF CLIP / SigLIP vision config dict (or a full CLIPConfig / SiglipConfig dict: its
    ``vision_config`` is used). The kind comes from ``model_type`` (``tower_kind``)."""
    kind = tower_kind(hf)
    hf = hf.get("vision_config", hf)
    defaults = tower_spec(kind).hf_defaults
    return VisionConfig(
        kind=kind,
        image_size=hf.get("image_size", 224),
        patch_size=hf.get("patch_size", defaults["patch_size"]),
        num_channels=hf.get("num_channels", 3),
        hidden_size=hf.get("hidden_size", 768),
        intermediate_size=hf.get("intermediate_size", 3072),
        num_layers=hf.get("num_hidden_layers", 12),
        num_heads=hf.get("num_attention_heads", 12),
        layer_norm_eps=hf.get("layer_norm_eps", defaults["layer_norm_eps"]),
        hidden_act=hf.get("hidden_act", defaults["hidden_act"]),
        vision_select_layer=select_layer,
        vision_select_feature=select,
    )


def select_feature_from_hf(kind: str, strategy: str) -> str:
    """neva's ``vision_select_feature`` for llava-hf's ``vision_feature_select_strategy`` on a ``kind`` tower.

    Raises:
        ConfigError: ``default`` on a tower without a class token: transformers then drops the first *patch*
            (``hidden_states[:, 1:]``), a model neva does not build.
    """
    table = tower_spec(kind).hf_select
    if strategy not in table:
        raise ConfigError(
            f"vision_feature_select_strategy={strategy!r} on a {kind} tower: transformers drops the first token as if "
            f"it were CLIP's class token, but a {kind} tower has none, so a real patch would be dropped; neva supports "
            + " or ".join(repr(k) for k in table)
        )
    return table[strategy]


def neva_config_from_llava(hf: dict[str, Any]) -> NevaConfig:
    """NevaConfig from a ``LlavaConfig`` dict (llava-hf ``config.json``)."""
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise ConfigError(f"unsupported projector_hidden_act {hf['projector_hidden_act']!r} (only gelu)")
    strategy = hf.get("vision_feature_select_strategy", "default")
    vision = vision_config_from_hf(
        hf["vision_config"],
        select_layer=hf.get("vision_feature_layer", -2),
        select=select_feature_from_hf(tower_kind(hf["vision_config"]), strategy),
    )
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    llm = llm_config_from_hf(text, "text_config")
    projector = ProjectorConfig(
        type="mlp2x_gelu",
        input_size=vision.feature_size,
        output_size=llm.hidden_size,
        bias=hf.get("multimodal_projector_bias", True),
    )
    token = hf.get("image_token_index", hf.get("image_token_id", 32000))
    return NevaConfig(
        llm=llm,
        vision=vision,
        projector=projector,
        image_token_id=token,
        anyres=anyres_from_hf(hf),
        **video_from_hf(hf),
    )


def anyres_from_hf(hf: dict[str, Any]) -> AnyResConfig | None:
    """``LlavaNextConfig``'s (and ``LlavaNextVideoConfig``'s) AnyRes (transformers lays tiles out only as
    ``spatial_unpad``), ``LlavaOnevisionConfig``'s with its ``vision_aspect_ratio`` pooling; None for ``llava``."""
    wrapper = wrapper_named(hf.get("model_type"))
    if wrapper is None or not wrapper.anyres:
        return None
    image_size = hf["vision_config"].get("image_size", 224)
    pins = parse_grid_pinpoints(hf["image_grid_pinpoints"], image_size)
    if not wrapper.pooled:
        return AnyResConfig(grid_pinpoints=pins)
    aspect = hf.get("vision_aspect_ratio", "anyres_max_9")
    if parse_aspect_ratio(aspect) is None:
        raise ConfigError(f"vision_aspect_ratio={aspect!r}: neva imports LLaVA-OneVision's anyres_max_N only")
    return AnyResConfig(grid_pinpoints=pins, max_num_patches=parse_aspect_ratio(aspect))


def llava_config_dict(cfg: NevaConfig, pad_token_id: int | None = None) -> dict[str, Any]:
    """``LlavaConfig`` kwargs (vision_config/text_config as dicts) for a NevaConfig; only ``mlp2x_gelu`` exports."""
    merge = {"mlp_downsample": "NeMo", "mlp_pixel_shuffle": "InternVL"}.get(cfg.projector.type if cfg.projector else "")
    if merge is not None:
        raise ConfigError(
            f"{cfg.projector.type} cannot be exported to HF LlavaForConditionalGeneration: transformers has no llava-hf "
            f"class with {merge}'s 2x2 patch merge and LayerNorm projector, and dropping them would be a different "
            "model; keep the neva checkpoint"
        )
    if cfg.anyres is not None and cfg.anyres.patch_merge_type != "spatial_unpad":
        raise ConfigError(
            f"mm_patch_merge_type={cfg.anyres.patch_merge_type} cannot be exported: transformers' "
            "LlavaNextForConditionalGeneration lays tiles out only as spatial_unpad (with image_newline)"
        )
    if cfg.anyres is not None and cfg.anyres.unpad_truncate:
        warnings.warn(
            "AnyRes unpad_truncate (a LLaVA-NeXT original import): transformers rounds the unpadded extent where "
            "LLaVA-NeXT truncates, so for about 0.02 % of image sizes the export keeps one feature row (or column) pair "
            "more than LLaVA-NeXT did",
            stacklevel=2,
        )
    if cfg.vision is None or cfg.projector is None or cfg.projector.type != "mlp2x_gelu":
        raise ConfigError("HF LlavaForConditionalGeneration needs a vision tower and an mlp2x_gelu projector")
    v, t = cfg.vision, cfg.llm
    rope = {"rope_type": "default", "rope_theta": t.rope_theta, **(t.rope_scaling or {})}
    select = v.vision_select_layer
    return dict(
        vision_config=dict(
            model_type=v.spec.hf_model_type,
            image_size=v.image_size,
            patch_size=v.patch_size,
            num_channels=v.num_channels,
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            num_hidden_layers=v.num_layers,
            num_attention_heads=v.num_heads,
            layer_norm_eps=v.layer_norm_eps,
            hidden_act=v.hidden_act,
            **(v.spec.hf_export_fields or {}),
        ),
        text_config=dict(
            **hf_family_fields(t),
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
        ),
        image_token_index=cfg.image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy=hf_select_strategy(v),
        vision_feature_layer=list(select) if isinstance(select, (list, tuple)) else select,
        image_seq_length=v.num_image_tokens,
        multimodal_projector_bias=cfg.projector.bias,
        tie_word_embeddings=t.tie_word_embeddings,
        # LlavaNextConfig (AnyRes); the config class follows from the model's features (hf_wrappers: wrapper_for)
        **({"image_grid_pinpoints": [list(p) for p in cfg.anyres.grid_pinpoints]} if cfg.anyres is not None else {}),
        **video_config_dict(cfg),  # LlavaNextVideoConfig
        **onevision_config_fields(cfg),  # LlavaOnevisionConfig (anyres_max_N)
    )


def hf_select_strategy(vision: VisionConfig) -> str:
    """llava-hf's ``vision_feature_select_strategy`` for a neva tower (SigLIP's ``patch`` is HF's ``full``)."""
    return {feature: strategy for strategy, feature in vision.spec.hf_select.items()}[vision.vision_select_feature]
