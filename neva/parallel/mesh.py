"""The run's one device mesh ``("pp", "dp", "cp", "tp")`` and the process groups derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from neva.parallel.layout import Layout

MESH_DIMS = ("pp", "dp", "cp", "tp")
# Gradients are reduced, and FSDP2 shards, over dp × cp flattened into one dimension (Megatron's data-parallel group
# with context parallelism): the cp ranks of one sequence each hold a share of its tokens' gradient.
DP_CP = "dp_cp"
FLATTENED = {DP_CP: ("dp", "cp")}
# dp (dp × cp with context parallelism: every dp and cp rank holds different tokens, as Megatron-Core draws its expert
# groups) as expert-parallel groups: (replicas of an expert group, ranks within one)
EXPERT_DIMS = ("edp", "ep")


@dataclass
class ParallelDims:
    """The mesh and its named sub-meshes; sizes of 1 are kept so code never branches on a missing dimension."""

    mesh: DeviceMesh
    layout: Layout
    # ``dp`` (or the flattened dp × cp) unflattened into ``("edp", "ep")`` (ep fastest: an expert group is ep
    # consecutive ranks of it), with expert parallelism only (``layout.ep > 1``).
    expert_mesh: DeviceMesh | None = None

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """dp × cp as one dimension (what gradients are reduced and parameters sharded over)."""
        return self.mesh[DP_CP]

    @property
    def grad_mesh(self) -> DeviceMesh:
        """What gradients are reduced and parameters sharded over: dp, or dp × cp with context parallelism."""
        return self.dp_cp_mesh if self.layout.cp > 1 else self.dp_mesh

    @property
    def cp_rank(self) -> int:
        return self.cp_mesh.get_local_rank()

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    @property
    def pp_rank(self) -> int:
        return self.pp_mesh.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.tp_mesh.get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh[dim].get_group()


def build_mesh(layout: Layout, timeout: timedelta | None = None) -> ParallelDims:
    """Create the mesh over all processes (the default process group must exist; a collective).

    ``timeout`` bounds every collective of the mesh's groups (``model.distributed_timeout_minutes``). It must be
    given here: ``init_device_mesh`` creates its sub-groups with torch's default timeout (30 min under gloo), not the
    default group's.
    """
    override = options = None
    if timeout is not None:
        options = _group_options("nccl" if layout.is_cuda else "gloo", timeout)
        override = dict.fromkeys(MESH_DIMS, options)
    mesh = init_device_mesh(
        layout.device_type,
        (layout.pp, layout.dp, layout.cp, layout.tp),
        mesh_dim_names=MESH_DIMS,
        backend_override=override,
    )
    if layout.cp > 1:
        mesh[FLATTENED[DP_CP]]._flatten(DP_CP, options)
    expert_mesh = None
    if layout.ep > 1:
        expert_override = None if options is None else dict.fromkeys(EXPERT_DIMS, options)
        tokens = mesh[DP_CP] if layout.cp > 1 else mesh["dp"]  # the ranks holding different tokens
        expert_mesh = tokens._unflatten(0, (layout.dp_cp // layout.ep, layout.ep), EXPERT_DIMS, expert_override)
    return ParallelDims(mesh, layout, expert_mesh)


def _group_options(backend: str, timeout: timedelta) -> Any:
    """Process-group options that carry ``timeout`` (``init_device_mesh`` takes a sub-group's timeout from them)."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options
