"""AdamW with NeMo/LLaVA conventions; the cosine schedule with linear warmup by neva's, HF's or NeMo's formula, and
transformers' linear-decay and constant schedules with warmup."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from neva.config import OptimConfig


def param_groups(named_params: list[tuple[str, nn.Parameter]], cfg: OptimConfig) -> list[dict]:
    """Groups: decayed weights, undecayed norms/biases/1-D tensors, and the projector and the vision tower at their
    own lr if set (without them, the groups and their order are what they were before the vision rate existed);
    DTensor parameters apart from plain ones (the fused and foreach kernels take one kind per call: expert
    parallelism under DDP holds ep-sharded experts beside plain replicas)."""
    groups: dict[tuple[bool, bool, bool], list[nn.Parameter]] = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        no_decay = p.ndim < 2 or name.endswith(".bias") or "norm" in name
        is_projector = cfg.projector_lr is not None and name.startswith("projector.")
        is_vision = cfg.vision_lr is not None and name.startswith("vision.")
        groups.setdefault((no_decay, is_projector, is_vision, isinstance(p, DTensor)), []).append(p)
    out = []
    for (no_decay, is_projector, is_vision, _), params in sorted(groups.items()):
        lr = cfg.projector_lr if is_projector else cfg.vision_lr if is_vision else cfg.lr
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
    """Warmup steps: ``warmup_steps``, else the ratio of ``max_steps``, rounded as the formula's source rounds it
    (HF's ``TrainingArguments.get_warmup_steps`` and neva: up; NeMo's ``int(warmup_ratio * max_steps)``: down)."""
    if cfg.sched.warmup_steps is not None:
        return cfg.sched.warmup_steps
    ratio = cfg.sched.warmup_ratio or 0.0
    return int(ratio * max_steps) if cfg.sched.formula == "nemo" else math.ceil(ratio * max_steps)


def _cosine(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * progress))


def cosine_lr_lambda(cfg: OptimConfig, max_steps: int, base_lr: float, first_base_lr: float | None = None):
    """Multiplier of ``base_lr`` for the optimizer step that follows ``s`` earlier steps (``s`` from 0), by
    ``cfg.sched.formula`` (``neva.config.SCHED_FORMULAS``).

    ``first_base_lr`` is the first parameter group's rate: NeMo's Megatron variant (``constant_steps > 0``) schedules
    every group by it (``max_lr=self.base_lrs[0]``); None = ``base_lr``.
    """
    warm, hold, min_lr = warmup_steps(cfg, max_steps), cfg.sched.constant_steps, cfg.sched.min_lr
    min_ratio = min_lr / base_lr if base_lr > 0 else 0.0

    def neva(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if step < warm + hold:
            return 1.0
        decay_steps = max(1, max_steps - warm - hold)
        progress = min(1.0, (step - warm - hold) / decay_steps)
        return min_ratio + (1 - min_ratio) * _cosine(progress)

    def hf(step: int) -> float:  # transformers' _get_cosine_schedule_with_warmup_lr_lambda, num_cycles 0.5
        if step < warm:
            return step / max(1, warm)
        return max(0.0, _cosine((step - warm) / max(1, max_steps - warm)))

    def nemo(step: int) -> float:  # nemo/core/optim/lr_scheduler.py: CosineAnnealing.get_lr at last_epoch=step
        if hold == 0:
            if warm > 0 and step <= warm:
                return (step + 1) / (warm + 1)
            if step > max_steps:
                return min_ratio
            return min_ratio + (1 - min_ratio) * _cosine((step - warm) / (max_steps - warm))
        top = first_base_lr if first_base_lr is not None else base_lr
        decay = max_steps - hold - warm
        if warm > 0 and step <= warm:
            lr = top * step / warm
        elif step > warm + decay:
            lr = min_lr
        else:
            lr = min_lr + (top - min_lr) * _cosine((step - warm) / decay)
        return lr / base_lr if base_lr > 0 else 0.0

    return {"neva": neva, "hf": hf, "nemo": nemo}[cfg.sched.formula]


def hf_lr_lambda(cfg: OptimConfig, max_steps: int, base_lr: float, first_base_lr: float | None = None):
    """transformers' ``get_linear_schedule_with_warmup`` / ``get_constant_schedule_with_warmup`` multiplier for the
    step after ``s`` earlier ones: ``s / warmup`` during warmup (0 at the first step), then linear to 0 at
    ``max_steps`` or constant 1."""
    warm = warmup_steps(cfg, max_steps)

    def linear(step: int) -> float:
        if step < warm:
            return step / max(1, warm)
        return max(0.0, (max_steps - step) / max(1, max_steps - warm))

    def constant(step: int) -> float:
        return step / max(1, warm) if step < warm else 1.0

    return {"linear": linear, "constant_with_warmup": constant}[cfg.sched.name]


# model.optim.sched.name -> the multiplier builder (neva.config.SCHEDULES)
LR_LAMBDAS = {
    "CosineAnnealing": cosine_lr_lambda,
    "cosine": cosine_lr_lambda,
    "linear": hf_lr_lambda,
    "constant_with_warmup": hf_lr_lambda,
}


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    lr_lambda = LR_LAMBDAS[cfg.sched.name]
    first = optimizer.param_groups[0]["base_lr"]
    lambdas = [lr_lambda(cfg, max_steps, g["base_lr"], first) for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
