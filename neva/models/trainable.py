"""What a run trains: the stage's freeze policy and LoRA adapters, applied to a model built on the meta device.

One rule for every user (training, the planner, the benchmark), so their parameter counts and FLOPs agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from neva.models.config import NevaConfig
from neva.models.lora import apply_lora
from neva.models.neva import NevaModel
from neva.models.vision import reaches_features


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the decoder's Linear layers named in ``targets``."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


@dataclass(frozen=True)
class TrainablePolicy:
    """Which parts train. With ``lora`` the decoder's own weights are frozen and only its adapters train."""

    vision: bool = False
    projector: bool = True
    llm: bool = False
    lora: LoraSpec | None = None


def apply_policy(model: NevaModel, policy: TrainablePolicy) -> None:
    """Set ``requires_grad`` of every parameter of ``model`` (adapters already in place) per ``policy``.

    A trained tower trains what reaches its features only (``neva.models.vision.reaches_features``): the layers past
    the selected one and the post-LayerNorm get no gradient (LLaVA-NeXT deletes its SigLIP's last layer for this), and
    data-parallel wrappers would wait for their gradients forever."""
    for name, p in model.named_parameters():
        part = name.split(".", 1)[0]
        if part == "vision":
            p.requires_grad_(policy.vision and reaches_features(model.cfg.vision, name.split(".", 1)[1]))
        elif part == "projector":
            p.requires_grad_(policy.projector)
        elif policy.lora is not None:
            p.requires_grad_(".lora_" in name)
        else:
            p.requires_grad_(policy.llm)


def build_meta_model(cfg: NevaConfig, policy: TrainablePolicy) -> NevaModel:
    """The model on the meta device, LoRA applied and parameters frozen per ``policy`` (no memory allocated)."""
    with torch.device("meta"):
        model = NevaModel(cfg)
        if policy.lora is not None:
            lora = policy.lora
            apply_lora(model, list(lora.targets), lora.rank, lora.alpha, lora.dropout)
    apply_policy(model, policy)
    return model


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
