"""From ``model.mm_cfg`` (presets or local HF directories) to a ``NevaConfig``."""

from __future__ import annotations

import json
import os

from neva.checkpoint.hf_config import llm_config_from_hf, vision_config_from_hf
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig, to_dict
from neva.models.presets import LLM_PRESETS, VISION_PRESETS
from neva.training.config import MMConfig
from neva.typed import ConfigError, build


def _read_hf_config(path: str, what: str) -> dict:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(f"{what}.from_pretrained={path!r}: no config.json there (expected a local HF directory)")
    with open(config) as f:
        return json.load(f)


def neva_config_from_mm(mm: MMConfig, vocab_size: int | None = None, image_token_id: int | None = None) -> NevaConfig:
    """The architecture a run trains.

    Args:
        mm: ``model.mm_cfg``.
        vocab_size: tokenizer size, which overrides the LLM vocab when given (the embedded default sizes its
            embedding to the synthetic tokenizer).
        image_token_id: id of ``<image>`` in the tokenizer (default: last id).
    """
    if mm.llm.from_pretrained:
        llm = to_dict(llm_config_from_hf(_read_hf_config(mm.llm.from_pretrained, "model.mm_cfg.llm")))
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
        vision = to_dict(vision_config_from_hf(_read_hf_config(v.from_pretrained, "model.mm_cfg.vision_encoder")))
    else:
        if v.preset not in VISION_PRESETS:
            raise ConfigError(
                f"model.mm_cfg.vision_encoder.preset={v.preset!r}; choose one of {sorted(VISION_PRESETS)}"
            )
        vision = dict(VISION_PRESETS[v.preset])
    vision.update(vision_select_layer=v.vision_select_layer, vision_select_feature=v.vision_select_feature)
    vision.update(v.arch_overrides)
    vision_cfg = build(VisionConfig, vision, "model.mm_cfg.vision_encoder.")
    projector = build(
        ProjectorConfig,
        dict(type=mm.mm_mlp_adapter_type, input_size=vision_cfg.feature_size, output_size=llm_cfg.hidden_size),
        "model.mm_cfg.mm_mlp_adapter_type.",
    )
    token = llm_cfg.vocab_size - 1 if image_token_id is None else image_token_id
    return NevaConfig(llm=llm_cfg, vision=vision_cfg, projector=projector, image_token_id=token)
