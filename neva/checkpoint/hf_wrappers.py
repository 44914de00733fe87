"""The transformers LLaVA wrappers a llava-hf directory is written as and read from: one row per kind.

A model's features alone pick its wrapper (``wrapper_for``): AnyRes tiles (LLaVA-NeXT), AnyRes grids pooled above
``anyres_max_N`` tiles (LLaVA-OneVision), video over AnyRes images (LLaVA-NeXT-Video), none of them (LLaVA-1.5). Its
row names what the export writes (config and model class, processor and image processor: ``hf_export``,
``hf_processors``) and tells the import what a ``model_type`` lays out (``hf_config``, ``hf_video``). The decoder
inside is ``hf_families``'s business; the video and pooled-AnyRes config fields are ``hf_video``'s and
``hf_onevision``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from neva.models.config import NevaConfig


@dataclass(frozen=True)
class Wrapper:
    """One transformers LLaVA kind; class names are attributes of the ``transformers`` package."""

    model_type: str  # config.json's model_type
    config_class: str
    model_class: str  # config.json's architectures
    processor_class: str
    # The image processor over AnyRes tiles (the PIL backend: torchvision is not needed); None: the tower's own
    # (CLIP's or SigLIP's, ``hf_processors.tower_image_processor``).
    image_processor: str | None
    # How that image processor sizes a tile: "crop" (shortest edge, then a centre crop of the tower's size: both no-ops
    # on tiles of that size) or "square" (resized to the tower's square).
    image_resize: str | None
    # The features that select the row: all three must be the model's.
    anyres: bool  # images as AnyRes tiles (``NevaConfig.anyres``)
    pooled: bool  # AnyRes grids above anyres_max_N tiles pooled (``AnyResConfig.max_num_patches``)
    video: bool  # videos, pooled per frame (``NevaConfig.video``)


# model_type, config class, model class; processor class, image processor, its resize; the features that select it
WRAPPERS = (
    Wrapper("llava", "LlavaConfig", "LlavaForConditionalGeneration",
            "LlavaProcessor", None, None,
            anyres=False, pooled=False, video=False),
    Wrapper("llava_next", "LlavaNextConfig", "LlavaNextForConditionalGeneration",
            "LlavaNextProcessor", "LlavaNextImageProcessorPil", "crop",
            anyres=True, pooled=False, video=False),
    Wrapper("llava_onevision", "LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration",
            "LlavaOnevisionProcessor", "LlavaOnevisionImageProcessorPil", "square",
            anyres=True, pooled=True, video=False),
    Wrapper("llava_next_video", "LlavaNextVideoConfig", "LlavaNextVideoForConditionalGeneration",
            "LlavaNextVideoProcessor", "LlavaNextImageProcessorPil", "crop",  # its images are LLaVA-NeXT's
            anyres=True, pooled=False, video=True),
)  # fmt: skip
_BY_MODEL_TYPE = {row.model_type: row for row in WRAPPERS}


def wrapper_for(cfg: NevaConfig) -> Wrapper:
    """The wrapper of a neva model: the row whose features are the model's.

    Raises:
        ValueError: features no transformers class has together (video without AnyRes, video with pooled AnyRes),
            named.
    """
    anyres = cfg.anyres is not None
    features = (anyres, anyres and cfg.anyres.max_num_patches is not None, cfg.video is not None)
    for row in WRAPPERS:
        if (row.anyres, row.pooled, row.video) == features:
            return row
    names = [name for name, has in zip(("AnyRes", "pooled AnyRes (anyres_max_N)", "video"), features) if has]
    raise ValueError(
        f"no transformers LLaVA class takes a model with {' + '.join(names)} "
        f"({', '.join(row.model_type for row in WRAPPERS)} do not); keep the neva checkpoint"
    )


def wrapper_named(model_type: str | None) -> Wrapper | None:
    """The row of a llava-hf ``config.json``'s ``model_type``; None for any other."""
    return _BY_MODEL_TYPE.get(model_type)
