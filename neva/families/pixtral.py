"""Mistral 3 / Pixtral (HF ``Mistral3ForConditionalGeneration``): Pixtral's variable-resolution tower, Mistral 3's
patch-merging projector and a Mistral decoder.

The tower (HF ``PixtralVisionModel``) reads each image at its own size: a bias-free patch convolution, an RMSNorm
before the blocks (``ln_pre``), 2-D rotary over each patch's (row, column) with its own frequencies per axis, attention
only among one image's patches, bias-free SwiGLU (its ``hidden_act``) blocks with RMSNorms (eps 1e-5, as HF fixes
them). The projector (HF ``Mistral3MultiModalProjector``) normalises each patch (RMSNorm at the decoder's eps),
merges each 2×2 block of the patch grid into one vector (channels outer, the four patches inner: ``unfold``'s order)
through a bias-free Linear, then Linear, GELU, Linear. An image is resized to fit ``image_size`` (HF ``longest_edge``)
on a grid of 2×2-patch blocks; its text is one ``[IMG]`` per merged token, ``[IMG_BREAK]`` after each row of them,
the last one ``[IMG_END]`` (``neva.data.pixtral_images``).

Its statistics are OpenAI CLIP's (``PixtralImageProcessor``'s), its merger reads the last block (``vision_feature_layer``
-1).
"""

from neva.constants import CLIP_MEAN, CLIP_STD
from neva.families.spec import MergerSpec, TowerSpec


def _check(cfg) -> None:
    if cfg.select_indices != [cfg.num_layers] or cfg.vision_select_feature != "patch":
        raise ValueError(
            "a pixtral tower's merger reads its last block: vision_select_layer must be -1 and vision_select_feature "
            f"patch, got {cfg.vision_select_layer} / {cfg.vision_select_feature}"
        )
    if (cfg.hidden_size // cfg.num_heads) % 4:
        raise ValueError(f"pixtral: head size {cfg.hidden_size // cfg.num_heads} must be a multiple of 4 (2-D rotary)")
    if cfg.temporal_patch_size != 1:
        raise ValueError(
            f"a pixtral tower reads single images: temporal_patch_size must be 1, got {cfg.temporal_patch_size}"
        )
    if cfg.image_size % (cfg.patch_size * cfg.spatial_merge_size):
        raise ValueError(
            f"pixtral image_size {cfg.image_size} (the longest edge) is not a multiple of patch_size × "
            f"spatial_merge_size ({cfg.patch_size * cfg.spatial_merge_size})"
        )


# Pixtral's named tower shapes (model.mm_cfg.vision_encoder.preset), gathered by neva.models.presets.
_PIXTRAL_PRESETS: dict[str, dict] = {
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
}

PIXTRAL = TowerSpec(
    kind="pixtral",
    tower="neva.models.vision_pixtral:PixtralTower",
    front_end="neva.data.pixtral_images:pixtral_images",
    interop="neva.checkpoint.hf_mistral3:MISTRAL3_INTEROP",
    projector="neva.models.projector_pixtral:PixtralMerger",
    native_sizes="neva.data.pixtral_images:planned_image",
    acts=("silu", "gelu"),
    class_tokens=0,
    mean=CLIP_MEAN,
    std=CLIP_STD,
    eps=1e-5,
    select=-1,
    patch_grid=True,
    merger=MergerSpec("pixtral_merger", norm="rms", decoder_eps=True),
    gated_mlp=True,
    image_text_tokens={"image_break_token_id": "[IMG_BREAK]", "image_end_token_id": "[IMG_END]"},
    template="neva.data.templates.mistral3:Mistral3Template",
    check=_check,
    presets=_PIXTRAL_PRESETS,
)
