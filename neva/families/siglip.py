"""SigLIP / SigLIP2 at a fixed resolution (LLaVA-OneVision's tower; HF ``SiglipVisionModel``): no class token, no
pre-LN, tanh-GELU, a biased patch embedding, one learned position per patch."""

from neva.constants import SIGLIP_MEAN, SIGLIP_STD
from neva.families.spec import TowerSpec

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
)
