"""Shared pieces of the planner tests: a tiny model with a run's freezing, one real AdamW step, measured bytes."""

from __future__ import annotations

import torch
from torch import nn

from neva.models.media import image_media
from neva.models.neva import NevaModel
from neva.models.presets import build_config
from neva.models.trainable import TrainablePolicy, apply_policy
from neva.parallel.layout import Layout
from neva.planner.deployment import Deployment
from neva.planner.params import ParamInfo, model_inventory


def policy(stage: str) -> TrainablePolicy:
    """What ``stage`` trains: the projector, and in finetune the LLM (the vision tower stays frozen)."""
    return TrainablePolicy(llm=stage == "finetune")


def tiny_model(stage: str, device: str = "cpu") -> NevaModel:
    """The tiny preset, initialised, with ``stage``'s freezing (training's ``apply_policy``)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = NevaModel(build_config())
    model.init_weights()
    apply_policy(model, policy(stage))
    return model


def tiny_inventory(stage: str) -> list[ParamInfo]:
    """The planner's inventory of ``tiny_model(stage)``."""
    return model_inventory(build_config(), policy(stage))


def batch(model: NevaModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Two samples: one image each (its tokens first), then text."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(0, cfg.image_token_id, (2, 8), generator=gen)
    image = torch.full((2, cfg.num_image_tokens), cfg.image_token_id)
    pixels = torch.randn(2, 3, cfg.vision.image_size, cfg.vision.image_size, generator=gen)
    return torch.cat([image, text], dim=1), pixels


def train_step(model: nn.Module, input_ids: torch.Tensor, pixels: torch.Tensor) -> torch.optim.Optimizer:
    """One forward/backward and AdamW step; returns the optimizer (its state now exists)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    out = model(input_ids, image_media(pixels))
    if hasattr(out, "full_tensor"):
        out = out.to_local()
    out.float().pow(2).mean().backward()
    opt.step()
    return opt


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank really stores (local shards)."""
    return sum(_local(p).numel() * p.element_size() for p in model.parameters())


def measured_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank really stores: parameters, gradients and optimizer state (local shards)."""
    params = param_bytes(model)
    grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    optimizer = sum(
        _local(v).numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return {"params": params, "grads": grads, "optimizer": optimizer}


def deployment(
    tp: int = 1, dp: int = 1, data_parallel: str = "fsdp", zero: int = 3, precision: str = "fp32"
) -> Deployment:
    """One node of ``tp × dp`` processes, two samples per micro-batch."""
    layout = Layout(
        tp=tp, dp=dp, data_parallel=data_parallel, zero_stage=zero, micro_batch_size=2, global_batch_size=2 * dp
    )
    compute = 4 if precision == "fp32" else 2
    return Deployment(layout, nodes=1, gpus_per_node=tp * dp, precision=precision, compute_bytes=compute)
