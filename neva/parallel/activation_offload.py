"""Activation offload (``model.activation_offload``): what decoder blocks save for backward waits in host memory.

Each decoder block's forward runs under saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, the
mechanism of torch's ``save_on_cpu``) that copy every activation autograd saves to host memory (page-locked on CUDA,
so the copy is asynchronous) and bring it back when backward unpacks it. Unlike ``save_on_cpu`` it keeps parameters
where they are (a block's weights are saved for its input gradient: copying them would move the model over the bus
twice per step and free nothing) and leaves host tensors alone, so on a CPU run it changes nothing. Beside
recomputation (``activations_checkpoint_granularity``) it trades bus traffic for memory instead of FLOPs; with
``full`` recomputation only each block's input is saved, and that is what goes to the host.

The hooks are entered and left by forward hooks of the block (its wrapper when the block is checkpointed), outside
any parallel wrapper's logic, so they compose with every layout: the values computed are the same, only where the
saved tensors wait differs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _pack(tensor: torch.Tensor) -> Any:
    if tensor.device.type == "cpu" or isinstance(tensor, nn.Parameter):
        return tensor
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=torch.cuda.is_available())
    host.copy_(tensor, non_blocking=True)
    return tensor.device, host


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


class _Offload:
    """Enters the hooks before a block's forward and leaves them after it (one context per call, stacked)."""

    def __init__(self) -> None:
        self.open: list[Any] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        context.__enter__()
        self.open.append(context)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.open.pop().__exit__(None, None, None)


def apply_activation_offload(layers: nn.ModuleDict) -> None:
    """Offload the saved activations of every block of ``layers`` (checkpoint wrappers included), in place."""
    for block in layers.values():
        offload = _Offload()
        block.register_forward_pre_hook(offload.enter)
        block.register_forward_hook(offload.leave, always_call=True)
