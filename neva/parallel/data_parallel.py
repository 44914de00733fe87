"""Data parallelism: FSDP2 (ZeRO-3 / ZeRO-2) with the O2 mixed-precision policy, or DDP.

O2 under FSDP2 is ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the sharded parameters (what the
optimizer steps) stay fp32 master weights, forward/backward all-gather them in bf16, gradients are reduce-scattered
and accumulated in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from neva.models.moe import Experts
from neva.models.neva import NevaModel


def apply_fsdp(
    model: NevaModel,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reshard: bool,
    expert_mesh: DeviceMesh | None = None,
    offload: bool = False,
) -> None:
    """``fully_shard`` each decoder block, then the rest of ``model`` (embeddings, norm, head, projector, vision).

    ``offload`` (``model.fsdp_offload``): torch's ``CPUOffloadPolicy``: the sharded parameters, their gradients and
    so the optimizer's states live in host memory (page-locked on CUDA); each group's forward and backward copies its
    shards to the device for the all-gather and its reduced gradient shards back, and the optimizer steps on the host.

    The root group is unsharded by ``model.forward``'s hook, which covers parts used without their own forward
    (the vision tower's ``features``, the position table). Under expert parallelism (``expert_mesh``, ``("edp",
    "ep")``) the experts, already split over ``ep``, are sharded over their replicas (``edp``) on their own.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    if expert_mesh is not None:
        # Even with one replica (edp of size 1: the reduce-scatter is a copy) FSDP2 holds the experts, so that the
        # O2 policy casts them as it casts every other parameter.
        for experts in (m for m in model.modules() if isinstance(m, Experts)):
            fully_shard(
                experts, mesh=expert_mesh["edp"], mp_policy=mp, reshard_after_forward=reshard, offload_policy=policy
            )
    for block in model.llm.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=policy)
    # The root is used last in forward and first in backward; resharding it right away would only add gathers.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=policy)


def fsdp_sync_context(parts: list[nn.Module]):
    """``sync_context(is_last)``: FSDP2 reduce-scatters gradients only in the last micro-batch's backward."""

    def context(is_last: bool) -> contextlib.AbstractContextManager:
        for part in parts:
            if isinstance(part, FSDPModule):
                part.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    return context


def ddp_sync_context(ddp: nn.parallel.DistributedDataParallel):
    """``sync_context(is_last)`` for torch DDP: ``no_sync`` on all but the last micro-batch."""
    return lambda is_last: contextlib.nullcontext() if is_last else ddp.no_sync()


@torch.no_grad()
def all_reduce_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average gradients over ``group`` in flat buckets (DDP's reduction, used when DDP cannot wrap the model:
    tensor- or pipeline-parallel layouts). DTensor gradients are reduced shard by shard."""
    grads = []
    for p in params:
        if p.grad is not None:
            g = p.grad
            grads.append(g.to_local() if isinstance(g, DTensor) else g)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    size = dist.get_world_size(group)
    for tensors in by_dtype.values():
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for g, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            g.copy_(reduced)
