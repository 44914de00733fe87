"""A neva checkpoint's architecture under the settings of the run that restores it (``model.restore_from_path``).

The checkpoint brings its architecture, weights and tokenizer. What each of the run's architecture settings does:

* added: AnyRes (``image_grid_pinpoints`` with ``image_aspect_ratio=anyres``, ``mm_patch_merge_type``) and video
  pooling (``mm_spatial_pool_stride`` / ``mm_spatial_pool_mode``) on a checkpoint without them, as LLaVA-NeXT's
  two-stage recipe does (pretrain at fixed resolution, finetune with AnyRes). A parameter that brings
  (``anyres.image_newline``) starts fresh (``neva.checkpoint.initial_weights``).
* refused, naming the key and both values: those settings where the checkpoint has them otherwise (AnyRes and video
  can be added, not changed or dropped), an ``arch_overrides`` entry or ``class_token_length`` that contradicts it.
* warned: settings that always hold a value (presets, projector type, the tower's feature selection) where the run
  gives another value than the schema's default, and the ``from_pretrained`` weight sources. Refusing would refuse
  every checkpoint unlike a chosen preset; a default is no choice, so it is not named (a first screen of warnings
  about keys never set hides the ones that matter).
"""

from __future__ import annotations

import dataclasses
import logging

from neva.checkpoint.architecture import anyres_from_mm, video_from_mm
from neva.config import MMConfig
from neva.models.anyres import AnyResConfig, anyres_on, parse_aspect_ratio, parse_grid_pinpoints
from neva.models.config import LLMConfig, NevaConfig, VisionConfig, to_dict
from neva.models.presets import LLM_PRESETS, VISION_PRESETS
from neva.models.video import VideoConfig
from neva.typed import ConfigError, build

log = logging.getLogger(__name__)

# Keys whose schema default is a value, not None: only a value other than the default says the run chose it.
_DEFAULTS = MMConfig()


def restored_config(mm: MMConfig, image_aspect_ratio: str, ckpt: NevaConfig, restore: str) -> NevaConfig:
    """``ckpt`` with the run's AnyRes / video pooling added where it has none.

    Args:
        mm: ``model.mm_cfg``.
        image_aspect_ratio: ``model.data.image_aspect_ratio``.
        ckpt: the checkpoint's architecture.
        restore: the checkpoint's path, for messages.

    Raises:
        ConfigError: a setting that contradicts the checkpoint's architecture (``check_restore_settings``, AnyRes or
            video already there with other values, AnyRes asked without pinpoints, or dropped); names the key.
    """
    check_restore_settings(mm, ckpt, restore)
    anyres, anyres_differ = _anyres(mm, image_aspect_ratio, ckpt)
    video, video_differ = _video(mm, ckpt)
    differ = [f"{key}={value!r} (the checkpoint has {held!r})" for key, value, held in anyres_differ + video_differ]
    if differ:
        raise ConfigError(
            f"model.restore_from_path={restore!r} gives the architecture, so {'; '.join(differ)} cannot apply: "
            "AnyRes and video pooling can be added to a checkpoint without them, not changed or dropped; set the "
            "checkpoint's value or remove the setting"
        )
    if anyres is ckpt.anyres and video is ckpt.video:
        return ckpt
    try:
        return dataclasses.replace(ckpt, anyres=anyres, video=video)
    except ValueError as err:
        raise ConfigError(f"model.restore_from_path={restore!r} with the run's AnyRes / video settings: {err}") from err


# (key, the run's value, the checkpoint's value) of the settings that differ from the checkpoint
Differences = list[tuple[str, object, object]]


def _anyres(mm: MMConfig, image_aspect_ratio: str, ckpt: NevaConfig) -> tuple[AnyResConfig | None, Differences]:
    have, given = ckpt.anyres, mm.image_grid_pinpoints is not None
    if have is None:
        if not anyres_on(image_aspect_ratio, mm.image_grid_pinpoints):
            return None, []
        return anyres_from_mm(mm, image_aspect_ratio, ckpt.vision.image_size), []  # stage two adds AnyRes
    if not image_aspect_ratio.startswith("anyres"):
        return have, [("model.data.image_aspect_ratio", image_aspect_ratio, _aspect_ratio(have))]
    # Compared field by field, not as a new AnyResConfig: one that could not be built is still named as a difference.
    pins = parse_grid_pinpoints(mm.image_grid_pinpoints, ckpt.vision.image_size) if given else have.grid_pinpoints
    merge = have.patch_merge_type
    if given or mm.mm_patch_merge_type != _DEFAULTS.mm_patch_merge_type:
        merge = mm.mm_patch_merge_type
    ratio = _aspect_ratio(have)
    if parse_aspect_ratio(image_aspect_ratio) != have.max_num_patches:
        ratio = image_aspect_ratio
    return have, _differ([
        ("model.mm_cfg.image_grid_pinpoints", _pins(pins), _pins(have.grid_pinpoints)),
        ("model.mm_cfg.mm_patch_merge_type", merge, have.patch_merge_type),
        ("model.data.image_aspect_ratio", ratio, _aspect_ratio(have)),
    ])  # fmt: skip


def _video(mm: MMConfig, ckpt: NevaConfig) -> tuple[VideoConfig | None, Differences]:
    have = ckpt.video
    if have is None:
        return video_from_mm(mm), []  # None without mm_spatial_pool_stride; stage two adds pooling
    stride = have.spatial_pool_stride if mm.mm_spatial_pool_stride is None else mm.mm_spatial_pool_stride
    mode = mm.mm_spatial_pool_mode
    if mm.mm_spatial_pool_stride is None and mode == _DEFAULTS.mm_spatial_pool_mode:
        mode = have.spatial_pool_mode  # the default, not restating the pooling: the checkpoint's holds
    return have, _differ([
        ("model.mm_cfg.mm_spatial_pool_stride", stride, have.spatial_pool_stride),
        ("model.mm_cfg.mm_spatial_pool_mode", mode, have.spatial_pool_mode),
    ])  # fmt: skip


def _differ(settings: Differences) -> Differences:
    return [(key, value, held) for key, value, held in settings if value != held]


def _pins(pinpoints: list) -> list[list[int]]:
    return [[int(h), int(w)] for h, w in pinpoints]


def _aspect_ratio(anyres: AnyResConfig) -> str:
    return "anyres" if anyres.max_num_patches is None else f"anyres_max_{anyres.max_num_patches}"


def _default(key: str) -> object:
    """The schema default of a ``model.mm_cfg.*`` key."""
    node: object = _DEFAULTS
    for name in key.removeprefix("model.mm_cfg.").split("."):
        node = getattr(node, name)
    return node


def check_restore_settings(mm: MMConfig, ckpt: NevaConfig, restore: str) -> None:
    """A checkpoint brings its architecture, weights and tokenizer: the settings that choose them otherwise are not
    applied. An explicit architecture override that contradicts the checkpoint is refused; the other settings are
    named in a warning when they would have given something else.

    Raises:
        ConfigError: an ``arch_overrides`` entry or ``class_token_length`` differs from the checkpoint's value.
    """
    v = mm.vision_encoder
    conflicts = [
        f"model.mm_cfg.{part}.arch_overrides.{key}={value!r} (the checkpoint has {getattr(have, key, None)!r})"
        for part, overrides, have in (("llm", mm.llm.arch_overrides, ckpt.llm), ("vision_encoder",
                                      v.arch_overrides, ckpt.vision))
        for key, value in overrides.items()
        if getattr(have, key, None) != value
    ]  # fmt: skip
    if v.class_token_length is not None and v.class_token_length != ckpt.vision.class_tokens:
        conflicts.append(
            f"model.mm_cfg.vision_encoder.class_token_length={v.class_token_length!r} "
            f"(the checkpoint has {ckpt.vision.class_tokens!r})"
        )
    if conflicts:
        raise ConfigError(
            f"model.restore_from_path={restore!r} gives the architecture, so {'; '.join(conflicts)} cannot apply; "
            "remove the override (or start from HF weights without restore_from_path)"
        )
    ignored = [
        (key, value, have)
        for key, value, have in (
            ("model.mm_cfg.llm.from_pretrained", mm.llm.from_pretrained, None),
            ("model.mm_cfg.vision_encoder.from_pretrained", v.from_pretrained, None),
            ("model.mm_cfg.mm_mlp_adapter_type", mm.mm_mlp_adapter_type, ckpt.projector.type),
            ("model.mm_cfg.vision_encoder.vision_select_layer", v.vision_select_layer, ckpt.vision.vision_select_layer),
            (
                "model.mm_cfg.vision_encoder.vision_select_feature",
                v.vision_select_feature,
                ckpt.vision.vision_select_feature,
            ),
        )
        if value not in (None, "") and value != have
    ]
    for key, part, table, cls, have in (
        ("model.mm_cfg.llm.preset", mm.llm, LLM_PRESETS, LLMConfig, ckpt.llm),
        ("model.mm_cfg.vision_encoder.preset", v, VISION_PRESETS, VisionConfig, ckpt.vision),
    ):
        if part.from_pretrained or part.preset not in table:
            continue  # from_pretrained is named above; an unknown preset name has no shape to compare
        arch = {**table[part.preset], **part.arch_overrides}
        if cls is LLMConfig:
            arch["vocab_size"] = have.vocab_size  # the tokenizer sizes it
        arch = to_dict(build(cls, arch, key + "."))
        differ = [
            f"{k}={getattr(have, k)!r}"
            for k, val in arch.items()
            if k not in ("vision_select_layer", "vision_select_feature", "image_mean", "image_std")
            and val != getattr(have, k, val)
        ]
        if differ:
            ignored.append((key, part.preset, ", ".join(differ[:4])))
    for key, value, have in ignored:
        if value == _default(key):
            continue  # a key the run never set says nothing (a value equal to the default is not a choice either)
        held = "" if have is None else f" (the checkpoint has {have if 'preset' in key else repr(have)})"
        log.warning(
            "%s=%r is ignored: model.restore_from_path=%s gives the weights, architecture and tokenizer%s",
            key, value, restore, held,
        )  # fmt: skip
