"""Tensor parallelism of a Gated DeltaNet layer (``neva.models.gated_deltanet``): each rank owns whole heads.

Megatron's split for linear attention: the q / k projections column-wise by key heads, v, z, b and a by value
heads (rank r's value heads are those its key heads serve, since both split evenly into contiguous blocks), the
depthwise filters of its q / k / v channels and the decay parameters (``A_log``, ``dt_bias``) of its value heads
as shards on dim 0 that the layer's forward reads as local tensors (``local_params``), the output projection
row-wise. The recurrence runs per head, so a rank needs nothing of another's until ``out_proj``'s all-reduce (or,
under sequence parallelism, reduce-scatter). The gated norm's weight (one per head channel, shared by the heads) is
replicated; each rank normalises its own heads, seen as a shard on the head dim so that the weight's gradient,
partial per rank, is all-reduced.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from neva.parallel.local_params import use_local_parameters

_SHARDED = ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias")


class LinearAttentionParallel(ParallelStyle):
    """The layer's own parameters (filters, decay) sharded by heads and read locally; under sequence parallelism its
    input gathered from the sequence shards (a plain, whole-sequence tensor: its packed-sample split indexes it)."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in _SHARDED:
            p = module._parameters[name]
            if not isinstance(p, DTensor):
                shard = distribute_tensor(p.detach(), device_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
        use_local_parameters(module)
        if self.sequence_parallel:
            # Block inputs are (x, cos, sin, plan, cache): only x is a sequence shard.
            PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None),
                use_local_output=True,
            )._apply(module, device_mesh)
        return module


class HeadShardedNorm(ParallelStyle):
    """The gated norm on this rank's heads: its inputs ``[B, S, heads / tp, d]`` viewed as shards on dim 2."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Shard(2),), run_check=False) for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


def linear_attention_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles of a block's linear-attention mixer (``attention``), keyed under the block."""
    plan: dict[str, ParallelStyle] = {"attention": LinearAttentionParallel(sequence_parallel)}
    for name in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a"):
        plan[f"attention.{name}"] = ColwiseParallel()
    plan["attention.norm"] = HeadShardedNorm()
    plan["attention.out_proj"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    return plan


def sharded_dim(style: ParallelStyle | None, leaf: str) -> int | None:
    """Dimension ``LinearAttentionParallel`` shards the layer's own parameter ``leaf`` on (None: not its)."""
    return 0 if isinstance(style, LinearAttentionParallel) and leaf in _SHARDED else None
