"""The llava-hf export of a pooled AnyRes model (LLaVA-OneVision's ``anyres_max_N``):
``LlavaOnevisionForConditionalGeneration``'s config fields and ``LlavaOnevisionProcessor``'s files.

The weights use the LlavaNext key layout (``hf_keys``, the one table the import reads too). transformers' OneVision
lays images out as neva's ``feature_index`` does under ``max_num_patches`` (``tests/models/test_anyres_onevision.py``)
and its processor counts the same positions. The video path is not exported: ``video_token_index`` is set to the
vocabulary size, an id no prompt holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neva.checkpoint.hf_video import write_processor_parts
from neva.checkpoint.hf_wrappers import wrapper_for
from neva.models.config import NevaConfig


def onevision_config_fields(cfg: NevaConfig) -> dict[str, Any]:
    """``LlavaOnevisionConfig``'s own fields (beside LlavaNext's) for a pooled AnyRes model; {} for any other."""
    if not wrapper_for(cfg).pooled:
        return {}
    return {"vision_aspect_ratio": f"anyres_max_{cfg.anyres.max_num_patches}", "video_token_index": cfg.llm.vocab_size}


def save_onevision_processor(
    directory: Path, cfg: NevaConfig, tokenizer: Any, image_processor: Any, fields: dict[str, Any]
) -> None:
    """``LlavaOnevisionProcessor``'s files, written from their parts (transformers 5 constructs it only with a video
    processor backend, i.e. torchvision): ``num_image_tokens`` is the tower's tokens per tile (class token included;
    the processor drops it again under ``vision_feature_select_strategy: default``)."""
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    v = cfg.vision
    video_processor = LlavaOnevisionVideoProcessor(
        size={"height": v.image_size, "width": v.image_size}, image_mean=list(v.image_mean), image_std=list(v.image_std)
    )
    fields = {
        "num_image_tokens": v.grid**2 + v.class_tokens,
        "vision_feature_select_strategy": fields["vision_feature_select_strategy"],
        "image_token": fields["image_token"],
        "video_token": "<video>",
        "vision_aspect_ratio": onevision_config_fields(cfg)["vision_aspect_ratio"],
    }
    write_processor_parts(directory, "LlavaOnevisionProcessor", tokenizer, image_processor, video_processor, fields)
