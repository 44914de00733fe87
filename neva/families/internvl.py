"""InternVL 3 / 3.5 (HF ``InternVLForConditionalGeneration``): InternViT at 448 px (a class token, layer scale, its
norm type, optional q / k norms), the pixel shuffle + LayerNorm + MLP projector (``mlp_pixel_shuffle``: 256 tokens
per tile), a Qwen2.5 or Qwen3 decoder; each image tiled into 1–12 tiles of 448 px on the grid whose aspect ratio is
closest to the image's, plus a 448-px thumbnail of the whole image when there is more than one tile (HF
``GotOcr2ImageProcessor`` with ``crop_to_patches``, which ``InternVLProcessor`` turns on), each tile one tower input;
an image's text is ``<img>`` + 256 × tiles ``<IMG_CONTEXT>`` + ``</img>`` (the ``internvl`` template).

Its statistics are ImageNet's (the InternVL hub checkpoints' ``preprocessor_config.json``; ``GotOcr2ImageProcessor``'s
own default is CLIP's), its norms' epsilon 1e-6, and InternVL reads the last block (``vision_feature_layer`` -1).
"""

from neva.families.spec import TowerSpec

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _check(cfg) -> None:
    if cfg.vision_select_feature != "patch":
        raise ValueError("an internvl tower's features drop its class token: vision_select_feature must be patch")


# InternViT's named tower shapes (model.mm_cfg.vision_encoder.preset), gathered by neva.models.presets.
_INTERNVL_PRESETS: dict[str, dict] = {
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
}

INTERNVL = TowerSpec(
    kind="internvl",
    tower="neva.models.vision_internvl:InternViT",
    front_end="neva.data.internvl_tiles:internvl_tiles",
    tiles="neva.data.internvl_tiles:planned_tiles",
    interop="neva.checkpoint.hf_internvl:INTERNVL_INTEROP",
    acts=("gelu",),
    class_tokens=1,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
    eps=1e-6,
    select=-1,
    block_options=True,
    template="neva.data.templates.internvl:InternVLTemplate",
    check=_check,
    presets=_INTERNVL_PRESETS,
)
