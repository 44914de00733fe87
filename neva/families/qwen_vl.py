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
)
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
)
