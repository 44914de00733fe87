"""Build what a run trains: tokenizer, model config, weights source, freeze policy, LoRA."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from neva.checkpoint import neva_format
from neva.checkpoint.dcp import named_parameters
from neva.data.datamodule import tokenizer_image_token_id
from neva.models.config import NevaConfig
from neva.models.lora import LoRALinear, apply_lora
from neva.models.neva import NevaModel
from neva.training.config import TrainConfig
from neva.training.model_config import neva_config_from_mm
from neva.typed import ConfigError

log = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where a run's architecture, tokenizer and initial weights come from."""

    cfg: NevaConfig
    tokenizer: Any
    checkpoint: str | None = None  # neva checkpoint to load weights from; None = fresh init (or HF import)
    hf_llm: str | None = None
    hf_vision: str | None = None


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
    if restore is not None:
        if not neva_format.is_neva_checkpoint(restore):
            raise ConfigError(f"model.restore_from_path={restore!r} is not a neva checkpoint directory")
        log.info("starting from neva checkpoint %s", restore)
        return ModelSource(neva_format.load_config(restore), neva_format.load_tokenizer(restore), checkpoint=restore)
    mm = cfg.model.mm_cfg
    if mm.llm.from_pretrained:
        from neva.checkpoint.hf import prepare_tokenizer

        tokenizer = prepare_tokenizer(mm.llm.from_pretrained)
        neva_cfg = neva_config_from_mm(
            mm, vocab_size=len(tokenizer), image_token_id=tokenizer_image_token_id(tokenizer)
        )
        return ModelSource(
            neva_cfg, tokenizer, hf_llm=mm.llm.from_pretrained, hf_vision=mm.vision_encoder.from_pretrained
        )
    from neva.data.synthetic import build_tokenizer

    tokenizer = build_tokenizer()
    neva_cfg = neva_config_from_mm(mm, vocab_size=len(tokenizer), image_token_id=tokenizer_image_token_id(tokenizer))
    return ModelSource(neva_cfg, tokenizer)


def build_meta_model(source: ModelSource, cfg: TrainConfig) -> NevaModel:
    """The model on the meta device, LoRA applied and parameters frozen per stage (no memory allocated)."""
    with torch.device("meta"):
        model = NevaModel(source.cfg)
        peft = cfg.model.peft
        if peft.peft_scheme == "lora":
            lora = peft.lora_tuning
            apply_lora(model, lora.target_modules, lora.adapter_dim, lora.alpha, lora.adapter_dropout)
    apply_freeze(model, cfg)
    return model


def apply_freeze(model: NevaModel, cfg: TrainConfig) -> None:
    """Stage policy: vision frozen unless configured, projector trains, LLM trains in finetune (LoRA: adapters only)."""
    mm = cfg.model.mm_cfg
    lora = cfg.model.peft.peft_scheme == "lora"
    for name, p in model.named_parameters():
        part = name.split(".", 1)[0]
        if part == "vision":
            p.requires_grad_(not mm.vision_encoder.freeze)
        elif part == "projector":
            p.requires_grad_(not mm.freeze_projector)
        elif lora:
            p.requires_grad_(".lora_" in name)
        else:
            p.requires_grad_(not mm.llm.freeze)


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


@torch.no_grad()
def materialize(model: nn.Module, source: ModelSource, device: torch.device, seed: int) -> None:
    """Allocate and fill the whole model: fresh init, then the checkpoint's or HF weights over it."""
    init_fresh(model, device, seed)
    load_source_weights([model], source)


class _Slot:
    """Where one full tensor read from disk goes: a parameter, or this rank's slice of a DTensor parameter."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param

    @property
    def shape(self) -> torch.Size:
        return self.param.shape  # the global shape, for DTensors too

    def copy_(self, full: torch.Tensor) -> None:
        p = self.param
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank read the same full tensor, so each slices locally (no collective).
            local = distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
        else:
            p.copy_(full)


class _Targets:
    """What the loaders write into (``cfg`` + ``state_dict()``): the parameters of ``parts`` under plain neva keys.

    Plain = without the LoRA ``.base`` and activation-checkpoint wrapper levels, as checkpoints and HF tables name them.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        self.cfg = parts[0].cfg
        self.slots = {name.replace(".base.", "."): _Slot(p) for name, p in named_parameters(parts)}

    def state_dict(self) -> dict[str, _Slot]:
        return dict(self.slots)


def load_source_weights(parts: list[nn.Module], source: ModelSource) -> None:
    """Read the neva checkpoint or the HF weights one full tensor at a time into ``parts`` (whole or sharded).

    Raises:
        KeyError: a neva checkpoint lacks a tensor these parts hold (LoRA adapters aside, which start fresh).
    """
    targets = _Targets(parts)
    if source.checkpoint is not None:
        filled = set()
        for key, full in neva_format.iter_tensors(source.checkpoint):
            slot = targets.slots.get(key)
            if slot is not None:  # None: another pipeline stage holds it
                slot.copy_(full)
                filled.add(key)
        missing = sorted(k for k in set(targets.slots) - filled if ".lora_" not in k)
        if missing:
            raise KeyError(f"{len(missing)} model tensor(s) not in {source.checkpoint}, e.g. {missing[:5]}")
    elif source.hf_llm is not None:
        from neva.checkpoint.hf import load_hf_weights

        load_hf_weights(targets, llm_dir=source.hf_llm, vision_dir=source.hf_vision)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total and trainable parameters, per part, for the log."""
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = name.split(".", 1)[0]
        counts[f"{part}/total"] = counts.get(f"{part}/total", 0) + p.numel()
        if p.requires_grad:
            counts[f"{part}/trainable"] = counts.get(f"{part}/trainable", 0) + p.numel()
    counts["total"] = sum(v for k, v in counts.items() if k.endswith("/total"))
    counts["trainable"] = sum(v for k, v in counts.items() if k.endswith("/trainable"))
    return counts
