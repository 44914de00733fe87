"""Expert parallelism: each MoE layer's experts split over ``ep`` data-parallel ranks, tokens sent to them and back.

The mesh's ``dp`` dimension is unflattened into ``("edp", "ep")`` (``mesh.EXPERT_DIMS``; ep fastest, as Megatron-Core
carves EP from DP); under context parallelism the flattened dp × cp is (every dp and cp rank holds different tokens,
so an expert group may span both: Megatron-Core's expert groups under CP). Rank ``r`` of an expert group owns experts ``[r E/ep, (r+1) E/ep)``: the stacked expert tensors
become ``DTensor``\\ s sharded on dim 0 over ``ep`` (checkpoints keep the whole tensors' names and shapes, so a run
resumes under another EP size or in one process). Routers, attention and every other parameter stay data-parallel
over all of dp as before.

Dispatch (``AllToAllDispatch``, installed as each MoE layer's ``dispatcher``: the model code is unchanged). The layer
hands over its tokens already grouped by global expert, with per-expert counts. Counts go first (one all-to-all of
``[ep, E/ep]`` integers), then the tokens (``all_to_all_single`` with uneven splits: each destination gets the
contiguous run of tokens for its experts); received tokens are regrouped by local expert, run through the local
experts (the ``Experts`` module: grouped GEMM or loop, on its local shard) and travel back the same way, so the layer combines
them exactly as in one process. Both all-to-alls are autograd functions whose backward is the reverse all-to-all.

Gradients. The engine scales every backward by dp × cp (data-parallel wrappers average over dp × cp). An expert's
gradient arrives, through the all-to-all's backward, from the tokens of every rank of its expert group, and FSDP2
(over ``edp``, when ``dp · cp > ep``) averages it over the group's replicas: ``dp · cp / edp = ep`` times the true
gradient, so the local expert weights' gradient is scaled by ``1 / ep`` (Megatron-Core scales expert gradients by
``edp / dp``):
the gradient reaching the experts' outputs is divided by ep and the one leaving their inputs multiplied back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from neva.models.moe import Experts, MoEFeedForward
from neva.parallel.local_params import use_local_parameters
from neva.typed import ConfigError


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back_out, back_in = ctx.splits
        out = grad.new_empty((sum(back_out), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), back_out, back_in, group=ctx.group)
        return out, None, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class AllToAllDispatch:
    """A MoE layer's dispatcher under expert parallelism (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, ep: int) -> None:
        self.group, self.ep = group, ep

    def __call__(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        send = counts.view(ep, -1)  # [destination rank, its local expert]: my tokens for each
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)  # [source rank, my local expert]
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = _AllToAll.apply(x, out_splits, in_splits, self.group)
        # Received rows come grouped by source rank, then local expert: regroup them by local expert.
        local_experts = recv.shape[1]
        segment = torch.repeat_interleave(torch.arange(recv.numel(), device=x.device), recv.flatten())
        order = (segment % local_experts * ep + segment // local_experts).argsort(stable=True)
        # The experts' weight gradients scaled by 1 / ep (module docstring): the gradient reaching their outputs is
        # scaled, the one leaving their inputs scaled back (exact for a power-of-two ep).
        rows = _ScaleGrad.apply(received[order], float(ep))
        y = _ScaleGrad.apply(experts(rows, recv.sum(0)), 1.0 / ep)  # a module call: FSDP2's hooks gather its shards
        y = y[order.argsort()]  # back to (source rank, local expert) order
        return _AllToAll.apply(y, in_splits, out_splits, self.group)


class UniformDispatch:
    """A dispatcher for steps on fake tensors (the full-size rehearsal, ``neva.training.rehearsal``): routing has no
    values there, so the token groups take the sizes of uniform routing, the load balance the aux loss aims at (each
    of a rank's experts gets ``N / local experts`` of its N rows), and under expert parallelism (``group``) each rank
    receives as many rows as it sends, through the same all-to-alls. A real step with balanced routing allocates the
    same; a skewed one shifts rows between experts and ranks (no token is dropped, so a rank's total varies)."""

    def __init__(self, ep: int = 1, group: dist.ProcessGroup | None = None) -> None:
        self.ep, self.group = ep, group

    def __call__(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.group is not None:
            split = _even(n, self.ep)
            x = _AllToAll.apply(x, split, split, self.group)
        y = experts(x, _even(n, counts.shape[0] // self.ep))
        return _AllToAll.apply(y, split, split, self.group) if self.group is not None else y


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def use_uniform_dispatch(model: nn.Module) -> None:
    """Give every MoE layer of ``model`` the ``UniformDispatch`` of its current dispatcher's expert group."""
    for moe in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
        current = moe.dispatcher
        ep, group = (current.ep, current.group) if isinstance(current, AllToAllDispatch) else (1, None)
        moe.dispatcher = UniformDispatch(ep, group)


def check_expert_parallel_layout(layout, llm) -> None:
    """What an MoE model and expert parallelism compose with.

    Raises:
        ConfigError: EP on a dense model, or over a number of experts it does not divide; the ``hf`` load-balancing
            formula under pipeline parallelism (it pools every layer's statistics into one loss, which no stage
            holds; ``megatron``'s per-layer sum is each stage's own).
    """
    if llm.is_moe and layout.pp > 1 and llm.moe_aux_loss_coeff and llm.moe_aux_loss_formula == "hf":
        raise ConfigError(
            "moe_aux_loss_formula=hf pools every layer's routing statistics into one loss, which pipeline stages "
            "cannot compute apart; use moe_aux_loss_formula=megatron (NeMo's, per layer) with "
            "model.pipeline_model_parallel_size > 1"
        )
    ep = layout.ep
    if ep == 1:
        return
    if not llm.is_moe:
        raise ConfigError(f"model.expert_model_parallel_size={ep} needs an MoE model (num_moe_experts)")
    if llm.num_moe_experts % ep:
        raise ConfigError(f"num_moe_experts={llm.num_moe_experts} is not divisible by expert_model_parallel_size={ep}")


def is_expert_param(p: torch.Tensor) -> bool:
    """An expert tensor sharded over ``ep`` (its data-parallel replicas are the ``edp`` ranks, not all of dp)."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over ``ep_mesh`` (dim 0) and install the all-to-all dispatcher (the layout
    passed ``check_expert_parallel_layout``)."""
    ep = ep_mesh.size()
    for moe in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            # Under TP the experts arrive replicated over tp (``tensor_parallel.ReplicatedLocal``): they stay so,
            # implicitly, as ep shards of the whole tensor that every tp rank of an expert group holds alike.
            whole = p.to_local() if isinstance(p, DTensor) else p
            sharded = distribute_tensor(whole.detach(), ep_mesh, [Shard(0)])
            setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        use_local_parameters(moe.experts)  # the experts run on their ep shard's local tensors
        moe.dispatcher = AllToAllDispatch(ep_mesh.get_group(), ep)
