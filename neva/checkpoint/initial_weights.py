"""Filling a (whole or sharded) model with its initial weights: fresh init from the run's seed, then a neva
checkpoint's or HF tensors read one full tensor at a time, each rank copying its slice (``ModelSource`` says which)."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from neva.checkpoint import neva_format
from neva.checkpoint.names import lora_layers, named_parameters
from neva.checkpoint.source import ModelSource
from neva.models.config import NevaConfig, ProjectorConfig
from neva.models.lora import LoRALinear, plain_key
from neva.models.neva import NevaModel

log = logging.getLogger(__name__)


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
        KeyError: a neva checkpoint lacks a tensor these parts hold (LoRA adapters and ``source.added`` aside,
            which start fresh).
        ValueError: a stored tensor whose shape is not the model's (names and shapes are all checked, from the file
            headers, before anything is copied).
    """
    targets = _Targets(parts)
    if source.checkpoint is not None:
        shapes = neva_format.tensor_shapes(source.checkpoint)
        missing = sorted(set(targets.slots) - set(shapes) - set(source.added))
        if missing:
            raise KeyError(f"{len(missing)} model tensor(s) not in {source.checkpoint}, e.g. {missing[:5]}")
        for key, slot in targets.slots.items():
            if key in shapes:
                neva_format.check_shape(key, shapes[key], slot.shape, source.checkpoint)
        fresh = fresh_parameters(source.cfg, source.added, source.seed)  # what stage two added to the checkpoint
        for key, full in itertools.chain(fresh.items(), neva_format.iter_tensors(source.checkpoint)):
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


def fresh_parameters(cfg: NevaConfig, keys: tuple[str, ...], seed: int) -> dict[str, torch.Tensor]:
    """Whole tensors of the parameters ``keys`` (ones a checkpoint lacks), initialised by the rule of the module that
    holds each, from ``seed`` alone: every layout, ``meta_init``'s shard-by-shard start included, copies its slice of
    the same values, and the global random state is left as it was."""
    if not keys:
        return {}
    with torch.device("meta"):
        model = NevaModel(cfg)
    out = {}
    for key in keys:
        owner, _, name = key.rpartition(".")
        module = model.get_submodule(owner)
        module.to_empty(device="cpu", recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module.init_weights()
        out[key] = getattr(module, name).detach()
    return out
