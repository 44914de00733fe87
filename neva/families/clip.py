"""CLIP's ViT (LLaVA-1.5's tower; HF ``CLIPVisionModel``): a class token, pre-LN, quick-GELU, fixed square input."""

from neva.constants import CLIP_MEAN, CLIP_STD
from neva.families.spec import TowerSpec

# CLIP's named tower shapes (model.mm_cfg.vision_encoder.preset), gathered by neva.models.presets.
_CLIP_PRESETS: dict[str, dict] = {
    "clip_vit_l14_224": dict(image_size=224, patch_size=14),
    "clip_vit_l14_336": dict(image_size=336, patch_size=14),
}

CLIP = TowerSpec(
    kind="clip",
    tower="neva.models.vision:VisionTower",
    front_end="neva.data.front_ends:fixed_or_tiled",
    interop="neva.checkpoint.llava_hf:LLAVA_HF",
    acts=("quick_gelu", "gelu"),
    class_tokens=1,
    mean=CLIP_MEAN,
    std=CLIP_STD,
    eps=1e-5,
    select=-2,
    fit="neva.data.images:resize_shortest_and_crop",  # LLaVA's CLIPImageProcessor: shortest side, centre crop
    hf_model_type="clip_vision_model",
    hf_defaults=dict(patch_size=32, layer_norm_eps=1e-5, hidden_act="quick_gelu"),
    # LLaVA's vision_feature_select_strategy: "default" drops the first token (the CLS), "full" keeps it.
    hf_select={"default": "patch", "full": "cls_patch"},
    hf_image_processor=("CLIPImageProcessor", "crop"),
    llava_original=True,
    presets=_CLIP_PRESETS,
)
