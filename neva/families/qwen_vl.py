"""The native-resolution Qwen towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; HF ``Qwen2VLVisionModel`` & co.): a 3-D patch
embedding, 2-D rotary, attention within each image or frame, a patch merger as the projector; each image at its own
patch grid under a pixel budget; videos as temporal patches with M-RoPE positions.

Their statistics are their HF processors' (Qwen2-VL / Qwen2.5-VL: OpenAI CLIP's; Qwen3-VL's hub
``preprocessor_config.json``: 0.5), their norms' epsilon is 1e-6, and their merger reads the last block's output.
Default pixel budgets: Qwen2-VL's and Qwen2.5-VL's are ``Qwen2VLImageProcessor``'s (56·56, 28·28·1280; their hub
preprocessor configs raise max_pixels to 12845056); Qwen3-VL's are its hub preprocessor config's (``size``:
shortest_edge 65536, longest_edge 16777216).
"""

import math

from neva.constants import CLIP_MEAN, CLIP_STD, SIGLIP_MEAN, SIGLIP_STD
from neva.families.spec import MergerSpec, TowerSpec, VideoRule

_SHARED = dict(
    front_end="neva.data.front_ends:native_images",
    interop="neva.checkpoint.hf_qwen_vl:QWEN_VL_INTEROP",
    class_tokens=0,
    eps=1e-6,
    select=-1,
    patch_grid=True,
)


def _check_tower(cfg) -> None:
    """What every Qwen tower needs: its merger reads the last block; 2-D rotary splits the head in four."""
    if cfg.select_indices != [cfg.num_layers] or cfg.vision_select_feature != "patch":
        raise ValueError(
            f"a {cfg.kind} tower's merger reads its last block: vision_select_layer must be -1 and "
            f"vision_select_feature patch, got {cfg.vision_select_layer} / {cfg.vision_select_feature}"
        )
    if (cfg.hidden_size // cfg.num_heads) % 4:
        raise ValueError(
            f"{cfg.kind}: head size {cfg.hidden_size // cfg.num_heads} must be a multiple of 4 (2-D rotary)"
        )
    for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        bad = [i for i in getattr(cfg, name) if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"vision {name} {bad} outside the {cfg.num_layers} layers")


def _check_windows(cfg) -> None:
    _check_tower(cfg)
    if cfg.window_size % (cfg.spatial_merge_size * cfg.patch_size):
        raise ValueError(
            f"qwen2_5_vl window_size {cfg.window_size} is not a multiple of spatial_merge_size × patch_size "
            f"({cfg.spatial_merge_size * cfg.patch_size})"
        )


def _check_position_grid(cfg) -> None:
    _check_tower(cfg)
    side = math.isqrt(cfg.num_position_embeddings)
    if side * side != cfg.num_position_embeddings:
        raise ValueError(f"qwen3_vl num_position_embeddings {cfg.num_position_embeddings} is not a square")


QWEN2_VL = TowerSpec(
    kind="qwen2_vl",
    tower="neva.models.vision_qwen2:Qwen2Tower",
    acts=("quick_gelu",),
    mean=CLIP_MEAN,
    std=CLIP_STD,
    merger=MergerSpec("qwen2_vl_merger", norm="layer"),
    video=VideoRule(per_frame=False, timed=False),
    pixels=(56 * 56, 28 * 28 * 1280),
    template="neva.data.templates.qwen_vl:QwenVLTemplate",
    check=_check_tower,
    **_SHARED,
)


# Qwen2.5-VL's named tower shapes (model.mm_cfg.vision_encoder.preset), gathered by neva.models.presets.
_QWEN2_5_VL_PRESETS: dict[str, dict] = {
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
}

QWEN2_5_VL = TowerSpec(
    kind="qwen2_5_vl",
    tower="neva.models.vision_qwen2:Qwen2Tower",
    acts=("silu",),
    mean=CLIP_MEAN,
    std=CLIP_STD,
    merger=MergerSpec("qwen2_5_vl_merger", norm="rms"),
    video=VideoRule(per_frame=False, timed=True),
    pixels=(56 * 56, 28 * 28 * 1280),
    window_attention=True,
    gated_mlp=True,
    template="neva.data.templates.qwen_vl:QwenVLTemplate",
    check=_check_windows,
    **_SHARED,
    presets=_QWEN2_5_VL_PRESETS,
)


_TINY_QWEN3_5 = dict(
    kind="qwen3_vl",
    image_size=64,
    patch_size=8,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    hidden_act="gelu_pytorch_tanh",
    num_position_embeddings=16,
)
# Qwen3-VL's named tower shapes, Qwen3.5's among them (model.mm_cfg.vision_encoder.preset), gathered by
# neva.models.presets.
_QWEN3_VL_PRESETS: dict[str, dict] = {
    # The tiny tower as Qwen3-VL's: LayerNorm + tanh-GELU blocks, a learned 4 × 4 position table resampled to each
    # image's grid, and both blocks' outputs as DeepStack features (joining decoder layers 0 and 1).
    "tiny_qwen3_vl": {**_TINY_QWEN3_5, "deepstack_visual_indexes": [0, 1]},
    # The tiny Qwen3-VL tower as Qwen3.5's: no DeepStack features.
    "tiny_qwen3_5": _TINY_QWEN3_5,
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
}

QWEN3_VL = TowerSpec(
    kind="qwen3_vl",
    tower="neva.models.vision_qwen3:Qwen3Tower",
    acts=("gelu_pytorch_tanh",),
    mean=SIGLIP_MEAN,
    std=SIGLIP_STD,
    merger=MergerSpec("qwen3_vl_merger", norm="layer", deepstack=True),
    video=VideoRule(per_frame=True, timed=False, served=False),
    pixels=(65536, 16777216),
    template="neva.data.templates.qwen_vl:Qwen3VLTemplate",
    check=_check_position_grid,
    **_SHARED,
    presets=_QWEN3_VL_PRESETS,
)
