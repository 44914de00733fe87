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
    """fp32 master copies of bf16 parameters and one flat fp32 main-grad buffer (Megatron's O2 bookkeeping).

    A post-accumulate-grad hook on each bf16 parameter adds its gradient into the parameter's slice of the flat fp32
    buffer as soon as autograd has finished it, and frees the bf16 gradient at once: bf16 gradients never pile up
    until the end of backward, and accumulation over micro-batches is exact in fp32. The master's ``.grad`` is that
    slice. A master whose ``.grad`` is None (after ``zero_grad(set_to_none=True)``) has its slice overwritten by the
    next gradient instead of added to, so the buffer needs no zeroing pass, and a parameter that received no gradient
    in a step keeps ``.grad`` None (AdamW leaves it, and its state, alone) — the per-parameter semantics of an fp32
    ``.grad`` per master. ``publish()`` writes the stepped masters back into the bf16 parameters with one foreach copy.

    Args:
        named_params: the trained parameters (one process: plain tensors on one device).
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]]) -> None:
        self.model_params = [p for _, p in named_params]
        self.named_master = [(n, nn.Parameter(p.detach().float().clone())) for n, p in named_params]
        device = self.model_params[0].device if self.model_params else torch.device("cpu")
        self.main_grad = torch.zeros(sum(p.numel() for p in self.model_params), dtype=torch.float32, device=device)
        self.main_grads: list[torch.Tensor] = []
        offset = 0
        for p in self.model_params:
            self.main_grads.append(self.main_grad[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulate_hook(m, g))
            for p, (_, m), g in zip(self.model_params, self.named_master, self.main_grads)
        ]

    @staticmethod
    def _accumulate_hook(master: nn.Parameter, main_grad: torch.Tensor):
        @torch.no_grad()
        def hook(param: nn.Parameter) -> None:
            if master.grad is None:
                main_grad.copy_(param.grad)
                master.grad = main_grad
            else:
                master.grad.add_(param.grad)
            param.grad = None

        return hook

    @torch.no_grad()
    def publish(self) -> None:
        if self.model_params:
            torch._foreach_copy_(self.model_params, [m for _, m in self.named_master])


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s parameters (not its buffers) to ``dtype`` in place, keeping each Parameter object.

    Buffers stay as built: RoPE's ``inv_freq`` in bf16 would put the rotary angle ~2.5 rad off at position 2047, and
    FSDP2's mixed-precision policy leaves buffers alone too, so both O2 paths compute the same positions.
    """
    for p in model.parameters():
        p.data = p.data.to(dtype)
