"""Precision policies: fp32, bf16 autocast, and bf16 O2 with fp32 master weights (FSDP2 keeps its own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Precision:
    """What a run computes in.

    Attributes:
        param_dtype: dtype of the model's parameters during forward/backward (bf16 under O2).
        autocast_dtype: dtype for ``torch.autocast`` (bf16-mixed), or None.
        master_weights: O2: the optimizer steps fp32 copies; gradients accumulate in fp32.
    """

    param_dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None
    master_weights: bool = False

    @classmethod
    def from_config(cls, precision: str | int, megatron_amp_O2: bool) -> Precision:
        """Lightning-style precision string plus NeMo's ``megatron_amp_O2`` flag."""
        p = str(precision)
        if p in ("32", "32-true"):
            if megatron_amp_O2:
                raise ValueError("model.megatron_amp_O2=true needs trainer.precision=bf16-mixed (or bf16)")
            return cls()
        if p in ("bf16", "bf16-mixed", "bf16-true"):
            if megatron_amp_O2:
                return cls(param_dtype=torch.bfloat16, master_weights=True)
            return cls(autocast_dtype=torch.bfloat16)
        raise ValueError(f"trainer.precision={p!r} is not supported; use 32, bf16-mixed or bf16 (+ megatron_amp_O2)")


class MasterWeights:
    """fp32 master copies of bf16 parameters, so the optimizer state and accumulation stay in fp32.

    After each micro-batch's backward, ``accumulate()`` moves the bf16 gradients into fp32 ``.grad`` of the master
    copies (so accumulation over micro-batches is exact in fp32); after the optimizer step, ``publish()`` writes the
    updated master values back into the bf16 model parameters.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]]) -> None:
        self.model_params = [p for _, p in named_params]
        self.named_master = [(n, nn.Parameter(p.detach().float().clone())) for n, p in named_params]

    def accumulate(self) -> None:
        for p, (_, m) in zip(self.model_params, self.named_master):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad.float())
            p.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        for p, (_, m) in zip(self.model_params, self.named_master):
            p.copy_(m)


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s parameters (not its buffers) to ``dtype`` in place, keeping each Parameter object.

    Buffers stay as built: RoPE's ``inv_freq`` in bf16 would put the rotary angle ~2.5 rad off at position 2047, and
    FSDP2's mixed-precision policy leaves buffers alone too, so both O2 paths compute the same positions.
    """
    for p in model.parameters():
        p.data = p.data.to(dtype)
