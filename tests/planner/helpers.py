"""Shared pieces of the planner tests: a tiny model with a run's freezing, one real AdamW step, measured bytes."""

from __future__ import annotations

import torch
from torch import nn

from neva.config import MMConfig, PeftConfig
from neva.models.neva import NevaModel
from neva.models.presets import build_config
from neva.planner.layout import Layout

STAGES = {
    # stage: (vision frozen, LLM frozen)
    "pretrain": (True, True),
    "finetune": (True, False),
}


def tiny_mm(stage: str) -> MMConfig:
    mm = MMConfig()
    mm.vision_encoder.freeze, mm.llm.freeze = STAGES[stage]
    return mm


def tiny_model(stage: str, device: str = "cpu") -> NevaModel:
    """The tiny preset, initialised, with ``stage``'s freezing (same rules as ``neva.planner.params.meta_model``)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = NevaModel(build_config())
    model.init_weights()
    mm = tiny_mm(stage)
    model.vision.requires_grad_(not mm.vision_encoder.freeze)
    model.llm.requires_grad_(not mm.llm.freeze)
    return model


def no_peft() -> PeftConfig:
    return PeftConfig()


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
    out = model(input_ids, pixels)
    if hasattr(out, "full_tensor"):
        out = out.to_local()
    out.float().pow(2).mean().backward()
    opt.step()
    return opt


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def measured_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank really stores: parameters, gradients and optimizer state (local shards)."""
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    optimizer = sum(
        _local(v).numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return {"params": params, "grads": grads, "optimizer": optimizer}


def layout(tp: int = 1, dp: int = 1, data_parallel: str = "fsdp", zero: int = 3, precision: str = "fp32") -> Layout:
    return Layout(
        nodes=1,
        gpus_per_node=tp * dp,
        tp=tp,
        pp=1,
        dp=dp,
        vpp=1,
        schedule="1f1b",
        sp=False,
        data_parallel=data_parallel,
        zero_stage=zero,
        precision=precision,
        compute_bytes=4 if precision == "fp32" else 2,
        ac=None,
        ac_num_layers=None,
        micro_batch_size=2,
        global_batch_size=2 * dp,
        first_stage_layers=None,
    )
