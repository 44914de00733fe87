"""The architecture a run trains from its settings (``model.mm_cfg``): presets or HF configs, the projector, AnyRes
and video; and reading an HF ``from_pretrained`` directory's config for it."""

from __future__ import annotations

import os

from neva.checkpoint import neva_format
from neva.checkpoint.hf_config import llm_config_from_hf, vision_config_from_hf
from neva.config import MMConfig
from neva.families.gemma3 import gemma3_tokens_per_image
from neva.hf_local import LocalModelError, model_dir
from neva.models.anyres import AnyResConfig, anyres_on, parse_aspect_ratio, parse_grid_pinpoints
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig, merger_fields, to_dict
from neva.models.presets import LLM_PRESETS, VISION_PRESETS
from neva.models.video import VideoConfig
from neva.typed import ConfigError, build


def neva_config_from_mm(
    mm: MMConfig,
    vocab_size: int | None = None,
    image_token_id: int | None = None,
    image_aspect_ratio: str | None = None,
) -> NevaConfig:
    """The architecture a run trains.

    Args:
        mm: ``model.mm_cfg``.
        image_aspect_ratio: ``model.data.image_aspect_ratio``; LLaVA-OneVision's ``anyres_max_N`` is part of the
            model (how many tiles' features an image keeps). None: the architecture alone is asked for (planner,
            tests), AnyRes follows ``image_grid_pinpoints`` as plain ``anyres``.
        vocab_size: tokenizer size, which overrides the LLM vocab when given (the embedded default sizes its
            embedding to the synthetic tokenizer).
        image_token_id: id of ``<image>`` in the tokenizer (default: last id).
    """
    if mm.llm.from_pretrained:
        llm = to_dict(llm_config_from_hf(read_hf_config(mm.llm.from_pretrained, "model.mm_cfg.llm")))
    else:
        if mm.llm.preset not in LLM_PRESETS:
            raise ConfigError(f"model.mm_cfg.llm.preset={mm.llm.preset!r}; choose one of {sorted(LLM_PRESETS)}")
        llm = dict(LLM_PRESETS[mm.llm.preset])
    llm.update(mm.llm.arch_overrides)
    if vocab_size is not None:
        llm["vocab_size"] = vocab_size
    llm_cfg = build(LLMConfig, llm, "model.mm_cfg.llm.")

    v = mm.vision_encoder
    if v.from_pretrained:
        vision = to_dict(vision_config_from_hf(read_hf_config(v.from_pretrained, "model.mm_cfg.vision_encoder")))
    else:
        if v.preset not in VISION_PRESETS:
            raise ConfigError(
                f"model.mm_cfg.vision_encoder.preset={v.preset!r}; choose one of {sorted(VISION_PRESETS)}"
            )
        vision = dict(VISION_PRESETS[v.preset])
    vision.update(vision_select_layer=v.vision_select_layer, vision_select_feature=v.vision_select_feature)
    vision.update(v.arch_overrides)
    vision_cfg = build(VisionConfig, vision, "model.mm_cfg.vision_encoder.")
    if v.class_token_length is not None and v.class_token_length != vision_cfg.class_tokens:
        raise ConfigError(
            f"model.mm_cfg.vision_encoder.class_token_length={v.class_token_length}, but the {vision_cfg.kind} tower "
            f"has {vision_cfg.class_tokens} class token(s) (CLIP 1, SigLIP 0); remove the key or choose the tower"
        )
    projector = dict(type=mm.mm_mlp_adapter_type, input_size=vision_cfg.feature_size, output_size=llm_cfg.hidden_size)
    projector.update(merger_fields(vision_cfg, llm_cfg))
    if mm.mm_mlp_adapter_type == "gemma3":  # its pooling and norm (neva/models/projector_gemma3.py)
        projector.update(tokens_per_image=gemma3_tokens_per_image(vision_cfg.grid), norm_eps=vision_cfg.layer_norm_eps)
    projector = build(ProjectorConfig, projector, "model.mm_cfg.mm_mlp_adapter_type.")
    token = llm_cfg.vocab_size - 1 if image_token_id is None else image_token_id
    # Without data settings, pinpoints mean plain anyres (no anyres_max_N pooling).
    ratio = image_aspect_ratio or ("square" if mm.image_grid_pinpoints is None else "anyres")
    anyres = anyres_from_mm(mm, ratio, vision_cfg.image_size) if anyres_on(ratio, mm.image_grid_pinpoints) else None
    return NevaConfig(
        llm=llm_cfg, vision=vision_cfg, projector=projector, image_token_id=token, anyres=anyres,
        video=video_from_mm(mm),
    )  # fmt: skip


def anyres_from_mm(mm: MMConfig, image_aspect_ratio: str, image_size: int) -> AnyResConfig:
    """The run's AnyRes (``image_grid_pinpoints`` given): pinpoints in pixels of tiles of ``image_size``."""
    arch = dict(
        grid_pinpoints=parse_grid_pinpoints(mm.image_grid_pinpoints, image_size),
        patch_merge_type=mm.mm_patch_merge_type,
        max_num_patches=parse_aspect_ratio(image_aspect_ratio),
    )
    return build(AnyResConfig, arch, "model.mm_cfg.")


def video_from_mm(mm: MMConfig) -> VideoConfig | None:
    """The run's video pooling; None without ``mm_spatial_pool_stride`` (the model takes no video)."""
    if mm.mm_spatial_pool_stride is None:
        return None
    pool = dict(spatial_pool_stride=mm.mm_spatial_pool_stride, spatial_pool_mode=mm.mm_spatial_pool_mode)
    return build(VideoConfig, pool, "model.mm_cfg.")


def hf_dir(path: str, what: str) -> str:
    """``from_pretrained``'s local directory (a Hub id resolves through the local HF cache only)."""
    try:
        return model_dir(path)
    except LocalModelError as err:
        raise ConfigError(f"{what}.from_pretrained: {err}") from err


def read_hf_config(path: str, what: str) -> dict:
    """The ``config.json`` of ``{what}.from_pretrained``; a NeMo or neva checkpoint, or a whole VLM given as the LLM,
    is refused saying what to pass instead."""
    neva_format.refuse_nemo_checkpoint(path, f"{what}.from_pretrained")
    path = hf_dir(path, what)
    if neva_format.is_neva_checkpoint(path):
        raise ConfigError(
            f"{what}.from_pretrained={path!r} is a neva checkpoint; start from it with model.restore_from_path"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{what}.from_pretrained={path!r}: no config.json there (expected a local HF directory)")
    from neva.checkpoint.hf_read import load_hf_config

    try:
        hf = load_hf_config(path)
    except LocalModelError as err:
        raise ConfigError(f"{what}.from_pretrained: {err}") from err
    if what.endswith(".llm") and "text_config" in hf:
        raise ConfigError(
            f"{what}.from_pretrained={path!r} is a whole vision-language model (model_type "
            f"{hf.get('model_type')!r}), not a Llama LLM: convert it with `python -m neva.convert hf-to-neva` and "
            "pass the output as model.restore_from_path (or give the LLM's own HF directory here)"
        )
    return hf
