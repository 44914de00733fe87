"""Where a run's architecture, tokenizer and initial weights come from, and filling a (whole or sharded) model
with them: fresh init, a neva checkpoint, or HF Llama + CLIP weights."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from neva.checkpoint import neva_format
from neva.checkpoint.hf_config import llm_config_from_hf, vision_config_from_hf
from neva.checkpoint.names import lora_layers, named_parameters
from neva.config import MMConfig, TrainConfig
from neva.data.datamodule import tokenizer_image_token_id
from neva.hf_local import LocalModelError, model_dir
from neva.models.anyres import AnyResConfig, parse_aspect_ratio, parse_grid_pinpoints
from neva.models.config import LLMConfig, NevaConfig, ProjectorConfig, VisionConfig, to_dict
from neva.models.lora import LoRALinear, plain_key
from neva.models.presets import LLM_PRESETS, VISION_PRESETS
from neva.models.video import VideoConfig
from neva.typed import ConfigError, build

log = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where a run's architecture, tokenizer and initial weights come from."""

    cfg: NevaConfig
    tokenizer: Any
    checkpoint: str | None = None  # neva checkpoint to load weights from; None = fresh init (or HF import)
    hf_llm: str | None = None
    hf_vision: str | None = None
    projector_weights: str | None = None  # LLaVA's mm_projector.bin (model.mm_cfg.pretrain_mm_mlp_adapter)


def default_pretrain_output() -> str:
    return os.path.join(os.environ.get("NEVA_OUTPUT_ROOT", "outputs"), "pretrain", "final")


def resolve_source(cfg: TrainConfig) -> ModelSource:
    """Decide the starting point of a run.

    Finetune without ``model.restore_from_path`` starts from the default pretrain output; a missing starting point
    is a config error that says what to run.
    """
    restore = cfg.model.restore_from_path
    if restore is None and cfg.stage == "finetune" and not cfg.model.mm_cfg.llm.from_pretrained:
        restore = default_pretrain_output()
        if not neva_format.is_neva_checkpoint(restore):
            raise ConfigError(
                f"finetune needs a pretrained model and none was found at {restore}. Run "
                "`python -m neva.train +stage=pretrain` first, or pass model.restore_from_path=/path/to/neva_checkpoint "
                "(a pretrain stage's final checkpoint, or `python -m neva.convert hf-to-neva` output)."
            )
    adapter = cfg.model.mm_cfg.pretrain_mm_mlp_adapter
    if adapter is not None and not os.path.isfile(adapter):
        raise ConfigError(f"model.mm_cfg.pretrain_mm_mlp_adapter={adapter!r}: no such file (LLaVA's mm_projector.bin)")
    if restore is not None and adapter is not None:
        raise ConfigError(
            f"model.mm_cfg.pretrain_mm_mlp_adapter={adapter!r} with model.restore_from_path={restore!r}: the checkpoint "
            "already holds a projector. Drop one of them (LLaVA uses the adapter to finetune from an HF LLM: "
            "model.mm_cfg.llm.from_pretrained)."
        )
    if restore is not None:
        neva_format.refuse_nemo_checkpoint(restore, "model.restore_from_path")
        if not neva_format.is_neva_checkpoint(restore):
            raise ConfigError(f"model.restore_from_path={restore!r} is not a neva checkpoint directory")
        log.info("starting from neva checkpoint %s", restore)
        ckpt_cfg = neva_format.load_config(restore)
        check_restore_settings(cfg.model.mm_cfg, ckpt_cfg, restore)
        return ModelSource(ckpt_cfg, neva_format.load_tokenizer(restore), checkpoint=restore)
    mm = cfg.model.mm_cfg
    if mm.llm.from_pretrained:
        from neva.checkpoint.hf_assemble import prepare_tokenizer

        _read_hf_config(mm.llm.from_pretrained, "model.mm_cfg.llm")  # a .nemo, neva or LLaVA path: say so first
        try:
            tokenizer = prepare_tokenizer(mm.llm.from_pretrained)
        except LocalModelError as err:
            raise ConfigError(f"model.mm_cfg.llm.from_pretrained: {err}") from err
        neva_cfg = neva_config_from_mm(
            mm, len(tokenizer), tokenizer_image_token_id(tokenizer), cfg.model.data.image_aspect_ratio
        )
        vision = mm.vision_encoder.from_pretrained
        return ModelSource(
            neva_cfg,
            tokenizer,
            hf_llm=_hf_dir(mm.llm.from_pretrained, "model.mm_cfg.llm"),
            hf_vision=_hf_dir(vision, "model.mm_cfg.vision_encoder") if vision else None,
            projector_weights=adapter,
        )
    from neva.data.synthetic import build_tokenizer

    tokenizer = build_tokenizer()
    neva_cfg = neva_config_from_mm(
        mm, len(tokenizer), tokenizer_image_token_id(tokenizer), cfg.model.data.image_aspect_ratio
    )
    return ModelSource(neva_cfg, tokenizer, projector_weights=adapter)


def check_restore_settings(mm: MMConfig, ckpt: NevaConfig, restore: str) -> None:
    """A checkpoint brings its architecture, weights and tokenizer: the settings that choose them otherwise are not
    applied. An explicit architecture override that contradicts the checkpoint is refused; the other settings are
    named in a warning when they would have given something else.

    Raises:
        ConfigError: an ``arch_overrides`` entry differs from the checkpoint's value.
    """
    conflicts = [
        f"model.mm_cfg.{part}.arch_overrides.{key}={value!r} (the checkpoint has {getattr(have, key, None)!r})"
        for part, overrides, have in (("llm", mm.llm.arch_overrides, ckpt.llm), ("vision_encoder",
                                      mm.vision_encoder.arch_overrides, ckpt.vision))
        for key, value in overrides.items()
        if getattr(have, key, None) != value
    ]  # fmt: skip
    if conflicts:
        raise ConfigError(
            f"model.restore_from_path={restore!r} gives the architecture, so {'; '.join(conflicts)} cannot apply; "
            "remove the override (or start from HF weights without restore_from_path)"
        )
    v = mm.vision_encoder
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
        held = "" if have is None else f" (the checkpoint has {have if 'preset' in key else repr(have)})"
        log.warning(
            "%s=%r is ignored: model.restore_from_path=%s gives the weights, architecture and tokenizer%s",
            key, value, restore, held,
        )  # fmt: skip


@torch.no_grad()
def init_fresh(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate ``model``'s (possibly sharded) parameters on ``device`` and initialise them, keeping ``requires_grad``."""
    requires = {n: p.requires_grad for n, p in model.named_parameters()}
    model.to_empty(device=device)
    model.tie_weights()
    torch.manual_seed(seed)
    model.init_weights()
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_parameters()
    for n, p in model.named_parameters():
        p.requires_grad_(requires[n])


class _Slot:
    """Where one full tensor read from disk goes: a parameter, or this rank's slice of a DTensor parameter."""

    def __init__(self, param: torch.Tensor, key: str) -> None:
        self.param = param
        self.key = key

    @property
    def shape(self) -> torch.Size:
        return self.param.shape  # the global shape, for DTensors too

    def copy_(self, full: torch.Tensor) -> None:
        copy_full(self.param, full, self.key)


@torch.no_grad()
def copy_full(target: torch.Tensor, full: torch.Tensor, key: str, source: Any = "weights") -> None:
    """Copy the whole tensor ``full`` into ``target``: a plain tensor, or this rank's slice of a DTensor.

    Raises:
        ValueError: ``full`` does not have ``target``'s (global) shape; names ``key`` and ``source``.
    """
    neva_format.check_shape(key, full.shape, target.shape, source)
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank read the same full tensor, so each slices locally (no collective).
        local = distribute_tensor(
            full.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(full)


class _Targets:
    """What the loaders write into (``cfg`` + ``state_dict()``): the parameters of ``parts`` under plain neva keys.

    Plain = without the LoRA ``.base`` and activation-checkpoint wrapper levels, as checkpoints and HF tables name them.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        self.cfg = parts[0].cfg
        self.slots = {}
        lora = lora_layers(parts)
        for name, p in named_parameters(parts):
            key = plain_key(name, lora)
            if key is not None:  # None: a LoRA adapter's own tensor, which starts fresh
                self.slots[key] = _Slot(p, key)

    def state_dict(self) -> dict[str, _Slot]:
        return dict(self.slots)


@torch.no_grad()
def load_source_weights(parts: list[nn.Module], source: ModelSource) -> None:
    """Read the neva checkpoint or the HF weights one full tensor at a time into ``parts`` (whole or sharded).

    Raises:
        KeyError: a neva checkpoint lacks a tensor these parts hold (LoRA adapters aside, which start fresh).
        ValueError: a stored tensor whose shape is not the model's (names and shapes are all checked, from the file
            headers, before anything is copied).
    """
    targets = _Targets(parts)
    if source.checkpoint is not None:
        shapes = neva_format.tensor_shapes(source.checkpoint)
        missing = sorted(set(targets.slots) - set(shapes))
        if missing:
            raise KeyError(f"{len(missing)} model tensor(s) not in {source.checkpoint}, e.g. {missing[:5]}")
        for key, slot in targets.slots.items():
            if key in shapes:
                neva_format.check_shape(key, shapes[key], slot.shape, source.checkpoint)
        for key, full in neva_format.iter_tensors(source.checkpoint):
            slot = targets.slots.get(key)
            if slot is not None:  # None: another pipeline stage holds it
                slot.copy_(full)
    elif source.hf_llm is not None:
        from neva.checkpoint.hf_assemble import load_hf_weights

        load_hf_weights(targets, llm_dir=source.hf_llm, vision_dir=source.hf_vision)
    if source.projector_weights is not None:
        load_projector_weights(targets, source.cfg.projector, source.projector_weights)


def load_projector_weights(targets: _Targets, cfg: ProjectorConfig, path: str) -> None:
    """Copy a published projector (``model.mm_cfg.pretrain_mm_mlp_adapter``) into the projector this rank holds.

    Raises:
        ValueError: the file's tensors are not exactly the projector's (``mm_mlp_adapter_type``) or a shape differs;
            names the key and both shapes, before anything is copied.
    """
    from neva.checkpoint.hf_read import read_projector_file
    from neva.models.projector import build_projector

    where = f"model.mm_cfg.pretrain_mm_mlp_adapter={path}"
    weights = read_projector_file(path)
    with torch.device("meta"):
        expected = {f"projector.{k}": p.shape for k, p in build_projector(cfg).state_dict().items()}
    if set(weights) != set(expected):
        raise ValueError(
            f"{where}: holds {sorted(weights)}, a {cfg.type!r} projector has {sorted(expected)} "
            "(model.mm_cfg.mm_mlp_adapter_type must be the one the file was trained with)"
        )
    for key, tensor in weights.items():
        neva_format.check_shape(key, tensor.shape, expected[key], where)
    for key, tensor in weights.items():
        slot = targets.slots.get(key)
        if slot is not None:  # None: another pipeline stage holds the projector
            slot.copy_(tensor)
    log.info("projector weights from %s", path)


def _hf_dir(path: str, what: str) -> str:
    """``from_pretrained``'s local directory (a Hub id resolves through the local HF cache only)."""
    try:
        return model_dir(path)
    except LocalModelError as err:
        raise ConfigError(f"{what}.from_pretrained: {err}") from err


def _read_hf_config(path: str, what: str) -> dict:
    neva_format.refuse_nemo_checkpoint(path, f"{what}.from_pretrained")
    path = _hf_dir(path, what)
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


def neva_config_from_mm(
    mm: MMConfig, vocab_size: int | None = None, image_token_id: int | None = None, image_aspect_ratio: str = "anyres"
) -> NevaConfig:
    """The architecture a run trains.

    Args:
        mm: ``model.mm_cfg``.
        image_aspect_ratio: ``model.data.image_aspect_ratio``; LLaVA-OneVision's ``anyres_max_N`` is part of the
            model (how many tiles' features an image keeps).
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
    if v.class_token_length is not None and v.class_token_length != vision_cfg.class_tokens:
        raise ConfigError(
            f"model.mm_cfg.vision_encoder.class_token_length={v.class_token_length}, but the {vision_cfg.kind} tower "
            f"has {vision_cfg.class_tokens} class token(s) (CLIP 1, SigLIP 0); remove the key or choose the tower"
        )
    projector = build(
        ProjectorConfig,
        dict(type=mm.mm_mlp_adapter_type, input_size=vision_cfg.feature_size, output_size=llm_cfg.hidden_size),
        "model.mm_cfg.mm_mlp_adapter_type.",
    )
    token = llm_cfg.vocab_size - 1 if image_token_id is None else image_token_id
    anyres = None
    if mm.image_grid_pinpoints is not None:
        pins = parse_grid_pinpoints(mm.image_grid_pinpoints, vision_cfg.image_size)
        arch = dict(grid_pinpoints=pins, patch_merge_type=mm.mm_patch_merge_type)
        arch["max_num_patches"] = parse_aspect_ratio(image_aspect_ratio)
        anyres = build(AnyResConfig, arch, "model.mm_cfg.")
    video = None
    if mm.mm_spatial_pool_stride is not None:
        video = build(
            VideoConfig,
            dict(spatial_pool_stride=mm.mm_spatial_pool_stride, spatial_pool_mode=mm.mm_spatial_pool_mode),
            "model.mm_cfg.",
        )
    return NevaConfig(
        llm=llm_cfg, vision=vision_cfg, projector=projector, image_token_id=token, anyres=anyres, video=video
    )
