"""GLM-4.1V's merger under tensor parallelism (``TowerSpec.projector_plan``): its downsampling Conv2d, proj and
LayerNorm run replicated on the gathered patches, then its SwiGLU is sharded as a decoder MLP is (the generic plan,
which alternates column- and row-wise Linear layers, would split the LayerNorm's input)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from neva.parallel.tensor_parallel import NoParallel


def glm4v_merger_plan(projector: nn.Module) -> dict[str, ParallelStyle]:
    """Module name → style of a ``Glm4vMerger``."""
    replicated: dict[str, ParallelStyle] = {name: NoParallel() for name in ("downsample", "proj", "norm")}
    return replicated | {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
