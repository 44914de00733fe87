"""AdamW with NeMo/LLaVA conventions, and the cosine schedule with linear warmup."""

from __future__ import annotations

import math

import torch
from torch import nn

from neva.config import OptimConfig


def param_groups(named_params: list[tuple[str, nn.Parameter]], cfg: OptimConfig) -> list[dict]:
    """Groups: decayed weights, undecayed norms/biases/1-D tensors, and the projector at its own lr if set."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        no_decay = p.ndim < 2 or name.endswith(".bias") or "norm" in name
        is_projector = cfg.projector_lr is not None and name.startswith("projector.")
        groups.setdefault((no_decay, is_projector), []).append(p)
    out = []
    for (no_decay, is_projector), params in sorted(groups.items()):
        lr = cfg.projector_lr if is_projector else cfg.lr
        out.append({"params": params, "weight_decay": 0.0 if no_decay else cfg.weight_decay, "lr": lr, "base_lr": lr})
    return out


def build_optimizer(named_params: list[tuple[str, nn.Parameter]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; fused on CUDA and CPU, foreach elsewhere."""
    if cfg.name.lower() not in ("adamw", "fused_adam", "adam"):
        raise ValueError(f"model.optim.name={cfg.name!r}: only adamw (alias fused_adam) is supported")
    groups = param_groups(named_params, cfg)
    if not groups:
        # A pipeline stage may hold only frozen parameters (pretraining: the projector lives on the first stage).
        # It still takes part in every step, so it keeps an optimizer that steps nothing; a model with nothing
        # trainable at all is refused before this (NevaModule.configure_model).
        groups = [{"params": [], "weight_decay": 0.0, "lr": cfg.lr, "base_lr": cfg.lr}]
    params = [p for g in groups for p in g["params"]]
    # The fused kernel (one pass over each parameter's state) exists for CUDA and CPU; on the CPU benchmark it steps
    # in a quarter of foreach's time. Other devices keep foreach.
    fused = bool(params) and len({p.device.type for p in params}) == 1 and params[0].device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None, foreach=None if fused else True
    )


def warmup_steps(cfg: OptimConfig, max_steps: int) -> int:
    if cfg.sched.warmup_steps is not None:
        return cfg.sched.warmup_steps
    return math.ceil((cfg.sched.warmup_ratio or 0.0) * max_steps)


def cosine_lr_lambda(cfg: OptimConfig, max_steps: int, base_lr: float):
    """Multiplier for step ``s``: linear warmup, constant hold, cosine decay to ``min_lr`` (NeMo CosineAnnealing)."""
    warm = warmup_steps(cfg, max_steps)
    hold = cfg.sched.constant_steps
    min_ratio = cfg.sched.min_lr / base_lr if base_lr > 0 else 0.0

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if step < warm + hold:
            return 1.0
        decay_steps = max(1, max_steps - warm - hold)
        progress = min(1.0, (step - warm - hold) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    if cfg.sched.name not in ("CosineAnnealing", "cosine"):
        raise ValueError(f"model.optim.sched.name={cfg.sched.name!r}: only CosineAnnealing is supported")
    lambdas = [cosine_lr_lambda(cfg, max_steps, g["base_lr"]) for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
