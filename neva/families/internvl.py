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
)
