"""transformers' ``LlavaNextVideoConfig``: the video fields of a ``llava_next_video`` config, read, known inert or
refused by name, and written back by an export (the images' fields are ``LlavaNextConfig``'s: ``hf_config``).

``LlavaNextVideoForConditionalGeneration`` runs every frame through the image tower, keeps the selected layer's patch
features, pools each frame's grid (``LlavaNextVideoPooler``: ``spatial_pool_mode`` over ``spatial_pool_stride``
windows) and only then projects (``neva.models.video.VideoPool`` in the same place).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neva.checkpoint.hf_families import CONFIG_BOOKKEEPING
from neva.checkpoint.hf_wrappers import wrapper_named
from neva.models.video import VideoConfig
from neva.typed import ConfigError

# The top-level fields of a LlavaNextVideoConfig and what neva does with them; any other field is refused.
_READ_ELSEWHERE = (  # hf_config.neva_config_from_llava reads them as it does for llava / llava_next
    "vision_config", "text_config", "image_token_index", "image_token_id", "projector_hidden_act",
    "vision_feature_select_strategy", "vision_feature_layer", "multimodal_projector_bias", "tie_word_embeddings",
    "image_grid_pinpoints",
)  # fmt: skip
_READ_HERE = ("spatial_pool_mode", "spatial_pool_stride", "video_token_index", "video_token_id")
# Processor hints (the number of placeholders the processor writes; neva counts them itself) and bookkeeping.
_INERT = ("image_seq_length", "video_seq_length")


def video_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``NevaConfig`` keyword arguments (``video``, ``video_token_id``) of a config dict; empty for a model without
    video.

    Raises:
        ConfigError: a pool mode neva does not implement (``conv``: a learned convolution), or a top-level field of a
            ``llava_next_video`` config that neva does not know, named.
    """
    wrapper = wrapper_named(hf.get("model_type"))
    if wrapper is None or not wrapper.video:
        return {}
    known = {*_READ_ELSEWHERE, *_READ_HERE, *_INERT, *CONFIG_BOOKKEEPING}
    unknown = sorted(k for k in hf if k not in known)
    if unknown:
        raise ConfigError(
            f"llava_next_video config: refused field(s) {unknown} (unknown to neva: may change the model)"
        )
    mode = hf.get("spatial_pool_mode", "average")
    if mode == "conv":
        raise ConfigError(
            "llava_next_video config: spatial_pool_mode='conv' (a learned Conv2d pool, vision_resampler weights) is "
            "not implemented; neva pools with average or max"
        )
    video = VideoConfig(spatial_pool_stride=int(hf.get("spatial_pool_stride", 2)), spatial_pool_mode=mode)
    token = hf.get("video_token_index", hf.get("video_token_id", 32000))
    return dict(video=video, video_token_id=int(token))


def video_config_dict(cfg: Any) -> dict[str, Any]:
    """The ``LlavaNextVideoConfig`` fields of a NevaConfig with video (empty without)."""
    if cfg.video is None:
        return {}
    if cfg.anyres is None:
        raise ConfigError(
            "a video model without AnyRes has no transformers class: LlavaNextVideoForConditionalGeneration lays "
            "images out as AnyRes tiles (image_newline included), so its images would be another model's; keep the "
            "neva checkpoint (docs/INTEROP.md, Video)"
        )
    if cfg.video_token_id is None or cfg.video_token_id == cfg.image_token_id:
        raise ConfigError(
            "LlavaNextVideo tells videos from images by their token: the model needs its own video_token_id"
        )
    return dict(
        spatial_pool_mode=cfg.video.spatial_pool_mode,
        spatial_pool_stride=cfg.video.spatial_pool_stride,
        video_token_index=cfg.video_token_id,
        video_seq_length=cfg.video.frame_tokens(cfg.vision.grid, cfg.num_image_tokens),
    )


def save_video_processor(
    directory: Path, cfg: Any, tokenizer: Any, image_processor: Any, fields: dict[str, Any]
) -> None:
    """``LlavaNextVideoProcessor``'s files (``processor_config.json`` with both processors, each processor's own
    file, the tokenizer), written from their parts: transformers 5 constructs that processor only where torchvision
    is installed (its video processor's backend), which neva does not need. The frames are processed as the tower's
    images are (CLIP's shortest-edge resize and centre crop, the tower's mean / std)."""
    from transformers.models.llava_next_video.video_processing_llava_next_video import LlavaNextVideoVideoProcessor

    v = cfg.vision
    video_processor = LlavaNextVideoVideoProcessor(
        size={"shortest_edge": v.image_size},
        crop_size={"height": v.image_size, "width": v.image_size},
        image_mean=list(v.image_mean),
        image_std=list(v.image_std),
    )
    fields = {**fields, "video_token": tokenizer.convert_ids_to_tokens(cfg.video_token_id)}
    write_processor_parts(directory, "LlavaNextVideoProcessor", tokenizer, image_processor, video_processor, fields)


def write_processor_parts(
    directory: Path, processor_class: str, tokenizer: Any, image_processor: Any, video_processor: Any, fields: dict
) -> None:
    """A video-capable processor's files without constructing it (its video backend needs torchvision): the
    tokenizer, each processor's own file (transformers 4.x reads those) and ``processor_config.json``."""
    tokenizer.save_pretrained(str(directory))
    image_processor.save_pretrained(str(directory))
    video_processor.save_pretrained(str(directory))
    config = {
        "processor_class": processor_class,
        **fields,
        "image_processor": image_processor.to_dict(),
        "video_processor": video_processor.to_dict(),
    }
    (Path(directory) / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
