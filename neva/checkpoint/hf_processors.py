"""The processor files of a llava-hf export: the image processor that prepares pixels as neva's data pipeline does,
and the processor of the model's wrapper (``hf_wrappers``) around it and the tokenizer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from neva.checkpoint.hf_config import hf_select_strategy
from neva.checkpoint.hf_onevision import save_onevision_processor
from neva.checkpoint.hf_video import save_video_processor
from neva.checkpoint.hf_wrappers import wrapper_for
from neva.models.config import NevaConfig, VisionConfig

# The processors transformers 5 constructs only with a video processor backend (torchvision), which neva does not
# need: their files are written from their parts.
_WRITTEN_FROM_PARTS = {"llava_next_video": save_video_processor, "llava_onevision": save_onevision_processor}


def save_processor(directory: Path, cfg: NevaConfig, tokenizer: Any, chat_template: str) -> None:
    """The wrapper's processor files (tokenizer included) with ``chat_template``; the caller's tokenizer keeps its
    own."""
    import transformers

    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = chat_template

    v = cfg.vision
    image_processor = hf_image_processor(cfg)
    fields = dict(
        patch_size=v.patch_size,
        vision_feature_select_strategy=hf_select_strategy(v),
        num_additional_image_tokens=v.class_tokens,  # CLIP's CLS ("default" removes it again); SigLIP has none
        image_token=tokenizer.convert_ids_to_tokens(cfg.image_token_id),
    )
    row = wrapper_for(cfg)
    if row.model_type in _WRITTEN_FROM_PARTS:
        _WRITTEN_FROM_PARTS[row.model_type](directory, cfg, tokenizer, image_processor, fields)
        return
    processor = getattr(transformers, row.processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **fields
    )
    processor.save_pretrained(str(directory))
    # transformers 4.x reads the image processor from its own file; 5.x from processor_config.json.
    image_processor.save_pretrained(str(directory))


def hf_image_processor(cfg: NevaConfig) -> Any:
    """The transformers image processor doing what neva's does for the model (``square`` aspect ratio): the tower's
    (``tower_image_processor``), or with AnyRes the wrapper's over the model's pinpoints (``LlavaNextImageProcessor``'s
    per-tile resize and crop no-ops on tiles of the tower's size, as ``neva.data.anyres`` tiles for both towers)."""
    row = wrapper_for(cfg)
    if row.image_processor is None:
        return tower_image_processor(cfg.vision)
    pinpoints = [list(p) for p in cfg.anyres.grid_pinpoints]
    return _image_processor(row.image_processor, row.image_resize, cfg.vision, image_grid_pinpoints=pinpoints)


def tower_image_processor(v: VisionConfig) -> Any:
    """The transformers image processor of a llava-hf tower ``v`` on whole images (``square`` aspect ratio): its
    family's (``TowerSpec.hf_image_processor``: CLIP resizes the short side and centre-crops, SigLIP resizes to the
    square)."""
    if v.spec.hf_image_processor is None:
        raise ValueError(f"a {v.kind} tower has no llava-hf image processor (its family exports its own processor)")
    return _image_processor(*v.spec.hf_image_processor, v)


def _image_processor(class_name: str, resize: str, v: VisionConfig, **fields: Any) -> Any:
    import transformers

    s = v.image_size
    sizes = {
        "crop": dict(size={"shortest_edge": s}, crop_size={"height": s, "width": s}),
        "square": dict(size={"height": s, "width": s}),
    }[resize]
    return getattr(transformers, class_name)(
        **sizes, **fields, image_mean=list(v.image_mean), image_std=list(v.image_std)
    )
