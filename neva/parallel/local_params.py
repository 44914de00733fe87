"""Show a module's forward the local tensors of its DTensor parameters, from outside the module.

Some computations cannot be written as DTensor ops: the experts of an MoE layer run on token groups whose sizes
depend on the routing (a rank's share of the experts, ``expert_parallel``; the router and experts replicated over
tensor-parallel ranks, ``tensor_parallel``). Their parameters stay DTensors for everything else (checkpoints by
global shape, the optimizer, gradient clipping); around each forward of the module, hooks swap every DTensor
parameter for its ``to_local()`` view and put the DTensor back after, the way FSDP2 swaps its unsharded parameters
in. ``to_local``'s backward hands the gradient to the DTensor parameter with its own placements (a shard's gradient
for an ``ep`` shard, a replica's for a replicated one). FSDP2's pre-forward hook is prepended, so under FSDP2 the
swap sees the parameters FSDP2 has just unsharded.
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.distributed.tensor import DTensor

_installed: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def use_local_parameters(module: nn.Module) -> None:
    """Install the swap on ``module`` (its direct parameters; once, however often it is asked)."""
    if module in _installed:
        return
    _installed.add(module)
    saved: dict[str, nn.Parameter] = {}

    def to_local(mod: nn.Module, args) -> None:
        for name, p in mod._parameters.items():
            if isinstance(p, DTensor):
                saved[name] = p
        for name, p in saved.items():
            mod._parameters[name] = p.to_local()

    def restore(mod: nn.Module, args, output):
        mod._parameters.update(saved)
        saved.clear()
        return output

    module.register_forward_pre_hook(to_local)
    module.register_forward_hook(restore, always_call=True)
