"""SigLIP / SigLIP2 at a fixed resolution (LLaVA-OneVision's tower; HF ``SiglipVisionModel``): no class token, no
pre-LN, tanh-GELU, a biased patch embedding, one learned position per patch."""

from neva.constants import SIGLIP_MEAN, SIGLIP_STD
from neva.families.spec import TowerSpec

# SigLIP's named tower shapes, Gemma 3's among them (model.mm_cfg.vision_encoder.preset), gathered by
# neva.models.presets.
_TINY_SIGLIP = dict(
    kind="siglip",
    image_size=32,
    patch_size=8,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    layer_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
)
# google/siglip-so400m-patch14-384 (config.json vision_config): 27×27 = 729 patches, width 1152, 27 layers.
_SO400M_384 = dict(
    kind="siglip",
    image_size=384,
    patch_size=14,
    hidden_size=1152,
    intermediate_size=4304,
    num_layers=27,
    num_heads=16,
    layer_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
)
# How Gemma 3 reads its SigLIP: the features after the post-LayerNorm (last_hidden_state), bilinear resize
# (Gemma3ImageProcessor; google/gemma-3-4b-it's preprocessor_config.json resample 2).
_GEMMA3_READING = dict(vision_select_layer=-1, feature_norm=True, image_resample="bilinear")
_SIGLIP_PRESETS: dict[str, dict] = {
    # The tiny tower as SigLIP (no class token: 16 image tokens, 4 with mlp_downsample).
    "tiny_siglip": _TINY_SIGLIP,
    "siglip_so400m_384": _SO400M_384,
    # The tiny tower as Gemma 3's SigLIP: a 4 × 4 patch grid the gemma3 projector pools to 2 × 2 tokens.
    "tiny_gemma3": {**_TINY_SIGLIP, **_GEMMA3_READING},
    # google/gemma-3-4b-it's tower (config.json vision_config: SigLIP so400m/14 at 896 px, 64 × 64 patches); the
    # gemma3 projector pools its features to 16 × 16 = 256 tokens.
    "siglip_so400m_896": {**_SO400M_384, "image_size": 896, **_GEMMA3_READING},
}

SIGLIP = TowerSpec(
    kind="siglip",
    tower="neva.models.vision_siglip:SiglipTower",
    front_end="neva.data.front_ends:fixed_or_tiled",
    interop="neva.checkpoint.llava_hf:LLAVA_HF",
    acts=("gelu_pytorch_tanh",),
    class_tokens=0,
    mean=SIGLIP_MEAN,
    std=SIGLIP_STD,
    eps=1e-5,
    select=-2,
    fit="neva.data.images:resize_square",  # SiglipImageProcessor: the whole image squashed to the square
    hf_model_type="siglip_vision_model",
    hf_defaults=dict(patch_size=16, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh"),
    hf_select={"full": "patch"},  # no class token: "full" is the patches
    hf_export_fields={"vision_use_head": False},  # LLaVA never runs SigLIP's pooling head
    hf_image_processor=("SiglipImageProcessor", "square"),
    # LLaVA's own CLIPVisionTower loads CLIP towers only: a LLaVA-original export cannot hold SigLIP.
    llava_original=False,
    llava_next_shortened=True,
    presets=_SIGLIP_PRESETS,
)
