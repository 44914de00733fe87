"""Gradient-norm clipping over every rank's shards with foreach kernels and one all-reduce.

Each rank sums the squares of its local gradient shards with one ``torch._foreach_norm`` per (device, dtype). A
gradient sharded over a mesh dimension contributes its local shard on every rank of that dimension; one replicated
over a dimension (DDP's gradients, a tensor-parallel layout's replicated parameters, FSDP's 1-D gradients seen from
the tensor-parallel dimension) contributes only on that dimension's coordinate 0, and pipeline stages hold disjoint
parameters. So a single sum over all ranks counts every element exactly once: one all-reduce of one scalar per
step, where a ``full_tensor()`` per parameter would cost one collective and one host sync each. A ``Partial``
gradient (a replicated weight whose input was sequence-sharded) is summed first, in one flat all-reduce per mesh
dimension that holds such gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from neva.parallel.mesh import EXPERT_DIMS, FLATTENED, MESH_DIMS, ParallelDims


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def _by_device_dtype(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _resolve_partial(grads: list[torch.Tensor], dims: ParallelDims) -> dict[int, torch.Tensor]:
    """Full local values of ``Partial`` DTensor gradients, summed over their partial mesh dimensions (copies; the
    gradients themselves stay as they are): ``{index in grads: local tensor}``."""
    pending: dict[str, list[int]] = {}
    for i, g in enumerate(grads):
        if isinstance(g, DTensor):
            names = g.device_mesh.mesh_dim_names
            for d, placement in enumerate(g.placements):
                if placement.is_partial():
                    pending.setdefault(names[d], []).append(i)
    values = {i: _local(grads[i]).clone() for ids in pending.values() for i in ids}
    for name, ids in pending.items():
        tensors = [values[i] for i in ids]
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat, group=dims.group(name))
        for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(reduced)
    return values


def _counted_here(g: torch.Tensor, coords: dict[str, int]) -> bool:
    """Whether this rank's copy of ``g`` counts: it is the coordinate-0 copy on every non-pipeline mesh dimension
    over which ``g`` is replicated (a ``Partial`` gradient is, once ``_resolve_partial`` has summed it)."""
    sharded = set()
    if isinstance(g, DTensor):
        names = g.device_mesh.mesh_dim_names
        # Every placement but Replicate and Partial splits the tensor (Shard, and FSDP2's _StridedShard on TP
        # parameters, whose is_shard() is False).
        sharded = {names[d] for d, p in enumerate(g.placements) if not (p.is_replicate() or p.is_partial())}
        # A flattened dimension (FSDP2 over dp × cp) shards over each of its factors.
        sharded |= {factor for name in tuple(sharded) for factor in FLATTENED.get(name, ())}
    # An expert tensor lives on the factors (edp, ep) of dp (of dp × cp under context parallelism); every other
    # tensor on dp and cp themselves.
    other = {"dp", "cp"} if sharded & set(EXPERT_DIMS) else set(EXPERT_DIMS)
    return all(coords[name] == 0 for name in coords if name not in ("pp", *sharded, *other))


@torch.no_grad()
def global_grad_norm(grads: Sequence[torch.Tensor], dims: ParallelDims | None, device: torch.device) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (fp32, on ``device``; no host sync), from this rank's ``grads``.

    ``dims``: the run's mesh (None in one process: nothing to reduce).
    """
    grads = list(grads)
    if dims is None:
        local = [_local(g) for g in grads]
    else:
        coords = dict(zip(MESH_DIMS, dims.mesh.get_coordinate()))
        if dims.expert_mesh is not None:
            coords.update(zip(EXPERT_DIMS, dims.expert_mesh.get_coordinate()))
        full = _resolve_partial(grads, dims)
        local = [full.get(i, _local(g)) for i, g in enumerate(grads) if _counted_here(g, coords)]
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for group in _by_device_dtype(local).values():
        norms = torch._foreach_norm(group, 2.0, dtype=torch.float32)
        sq += torch.stack(norms).to(device).square().sum()
    if dims is not None and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


@torch.no_grad()
def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + 1e-6))``: one foreach multiply per (device, dtype), the
    coefficient staying on the device. ``max_norm`` <= 0 leaves them as they are (``gradient_clip_val`` 0 = no
    clipping, as LLaVA-1.5 ran: a 0 coefficient would erase the gradients)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for (device, dtype), group in _by_device_dtype([_local(g) for g in grads]).items():
        torch._foreach_mul_(group, coef.to(device, dtype))
