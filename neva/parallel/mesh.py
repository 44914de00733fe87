"""The run's one device mesh ``("pp", "dp", "tp")`` and the process groups derived from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from neva.training.strategy import Layout

MESH_DIMS = ("pp", "dp", "tp")

_current: ParallelDims | None = None


@dataclass
class ParallelDims:
    """The mesh and its named sub-meshes; sizes of 1 are kept so code never branches on a missing dimension."""

    mesh: DeviceMesh
    layout: Layout

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

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


def build_mesh(layout: Layout, device_type: str) -> ParallelDims:
    """Create the mesh (the default process group must exist) and remember it for ``current()``."""
    global _current
    mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=MESH_DIMS)
    _current = ParallelDims(mesh, layout)
    return _current


def current(layout: Layout | None = None, device_type: str = "cpu") -> ParallelDims:
    """The mesh the strategy built; builds one from ``layout`` when called outside Lightning (tests, tools)."""
    if _current is None or (layout is not None and _current.layout != layout):
        if layout is None:
            raise RuntimeError("no device mesh yet: the distributed strategy builds it when the processes start")
        return build_mesh(layout, device_type)
    return _current
