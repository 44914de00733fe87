"""Context parallelism: every row of a micro-batch split over the ``cp`` ranks of a mesh dimension.

The ``cp`` ranks of one data-parallel rank read the same micro-batches (the samplers are keyed on the dp rank). Each
splits every micro-batch on the host (``split_batch``: ``neva.data.micro_batch.MicroBatch.split_columns``), load-balanced for causal attention as Megatron does: the row
length is padded to a multiple of ``2 · cp`` and cut into ``2 · cp`` chunks; rank r holds chunks ``r`` and
``2 · cp − 1 − r`` (a front chunk, whose queries see few keys, and a back one, whose queries see many). Everything
per token goes with its tokens: ids, ``position_ids`` ``[P, B, S]`` (RoPE then uses each token's global position),
segment ids, LoRA dropout keys; the learned positions (``output_positions`` / ``targets``) and the media positions
keep those on this rank's columns, remapped to local ones.

The model receives a ``ContextShard`` (``neva.models.context_shard``) carrying the whole rows' segment ids and
``all_gather``, this module's differentiable all-gather over the cp group:

- attention: every layer all-gathers its keys and values (one collective of ``2 · S / cp`` tokens' worth per rank)
  and the local queries attend per segment. All-gather, not a ring: it is exact with the per-segment kernels
  unchanged (packing, sliding windows), needs no online-softmax merge of partial results, and its cost — the whole
  row's keys and values on every rank for one layer at a time — is small beside the activations CP divides
  (``num_kv_heads · head_dim`` per token, a fraction of the hidden size under GQA). Measured, the gathers'
  exposed time is 5-7 % of a CP2 step on CPU and planned at 1-7 % of an H100 step (``scripts/benchmark.py
  --context-parallel``, docs/PERFORMANCE.md): all a ring, overlapping the transfer with compute, could save;
- media: each cp rank encodes its share of the micro-batch's tower inputs (images, AnyRes tiles, video frames,
  balanced by count; a native-resolution tower's images and videos, whole items balanced by patches) and the
  projected features (and Qwen3-VL's DeepStack features) are all-gathered; each rank writes those at its positions.

Loss and gradients: each rank's summed token loss covers its own learned tokens, normalised by the learned tokens
of the whole global batch (counted before the split, summed over dp); gradients are reduced over dp × cp (FSDP2
shards over it), so the step equals one process's (``neva.training.engine``). Expert parallelism draws its groups
from dp × cp (``mesh.build_mesh``): an MoE layer's all-to-all exchanges the tokens of ranks holding different
chunks, and an expert's gradient is reduced over the ``dp · cp / ep`` ranks holding the same experts. With that, no
layout or model is refused here; ``check_context_parallel_objective`` refuses what the split does not compute
(``micro_batch_mean`` with PP; a head objective that is not written for a shard), one of the run's start-time rules
(``run_rules.check_run``: training, the planner and the support matrix alike).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from neva.data.micro_batch import MicroBatch
from neva.models.decoder_traits import traits
from neva.parallel.layout import Layout
from neva.typed import ConfigError


def check_context_parallel_objective(layout: Layout, loss_normalization: str, head: str | None = None) -> None:
    """Refuse an objective the split does not compute yet (listed in ``run_rules.check_run``, which training and the
    planner both ask, so a layout search proposes only what training runs). ``head``: the name of a head objective not written for a shard of the
    rows (``HeadObjective.context_parallel`` False), else None (token cross-entropy and DPO's pair objective are).

    Raises:
        ConfigError: cp > 1 with pipeline parallelism and a loss normalisation other than ``global_tokens``, or with
            such a head objective.
    """
    if layout.cp == 1:
        return
    if layout.pp > 1 and loss_normalization != "global_tokens":
        raise ConfigError(
            f"model.loss_normalization={loss_normalization} with model.context_parallel_size={layout.cp} and "
            "model.pipeline_model_parallel_size > 1: the pipeline's loss sees one shard of a micro-batch, not its "
            "own learned tokens; use global_tokens"
        )
    if head is not None:
        raise ConfigError(
            f"model.context_parallel_size={layout.cp} cannot train {head} (its per-sequence terms would need a "
            "reduction over the cp ranks)"
        )


def check_context_parallel_model(layout: Layout, llm: Any) -> None:
    """Refuse a decoder whose attention a shard of the rows cannot compute yet (training's ``parallelize``, the support
    matrix and the planner ask).

    Raises:
        ConfigError: cp > 1 with a decoder whose images attend both ways (Gemma 3): a rank's chunks would hold part of
            an image's block, whose queries need its later keys too; or with chunked attention (Llama 4).
    """
    if layout.cp > 1 and traits(llm).bidirectional_images:
        raise ConfigError(
            f"model.context_parallel_size={layout.cp} with a {llm.family} decoder is not supported yet: its image "
            "tokens attend to one another both ways, which the causal shard split does not compute"
        )
    if layout.cp > 1 and llm.attention_chunk_size is not None:
        raise ConfigError(
            f"model.context_parallel_size={layout.cp} with a {llm.family} decoder is not supported yet: its "
            f"chunked_attention layers attend within {llm.attention_chunk_size}-token chunks of each sample, which the "
            "shard split's gathered keys do not cut"
        )


def split_batch(
    batch: MicroBatch, cp: int, rank: int, group: Any, packed: bool, rotation: int = 0, multiple: int = 1
) -> MicroBatch:
    """This rank's share of a collated (host) micro-batch (``MicroBatch.split_columns``), its ``context`` gathering
    over ``group`` (``rotation``: see ``ContextShard``; ``multiple``: each rank's columns a multiple of it, sequence
    parallelism's tp)."""
    return batch.split_columns(
        cp, rank, lambda t, dim, sizes: all_gather(t, dim, sizes, group), packed, rotation=rotation, multiple=multiple
    )


class _AllGather(torch.autograd.Function):
    """Every rank's tensor concatenated along ``dim`` in rank order; backward: each rank's slice of the gradient
    summed over the ranks (every rank's queries attended every rank's keys)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dim: int, sizes: list[int], group: Any) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        rank = dist.get_rank(group)
        ctx.rank = rank
        front = t.movedim(dim, 0).contiguous()
        widest = max(sizes)
        if front.shape[0] < widest:  # all_gather takes equal shapes: pad to the widest share
            front = torch.cat([front, front.new_zeros(widest - front.shape[0], *front.shape[1:])])
        parts = [torch.empty_like(front) for _ in sizes]
        dist.all_gather(parts, front, group=group)
        full = torch.cat([p[:n] for p, n in zip(parts, sizes)])
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sizes, rank = ctx.sizes, ctx.rank
        front = grad.movedim(ctx.dim, 0).contiguous()
        if dist.get_backend(ctx.group) == "nccl" and len(set(sizes)) == 1:
            out = front.new_empty(sizes[rank], *front.shape[1:])
            dist.reduce_scatter_tensor(out, front, group=ctx.group)
        else:  # gloo has no reduce-scatter of one tensor: sum everything, keep this rank's slice
            dist.all_reduce(front, group=ctx.group)
            start = sum(sizes[:rank])
            out = front[start : start + sizes[rank]]
        return out.movedim(0, ctx.dim), None, None, None


class _AllReduceSum(torch.autograd.Function):
    """The sum over the group, on every rank; backward: the gradients summed too (every rank's objective used the
    sum)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable sum of ``t`` over ``group`` (MoE routing statistics of a row split over cp ranks)."""
    return _AllReduceSum.apply(t, group)


def all_gather(t: torch.Tensor, dim: int, sizes: list[int], group: Any) -> torch.Tensor:
    """Differentiable all-gather along ``dim`` over ``group`` (``sizes``: each rank's extent along ``dim``)."""
    return _AllGather.apply(t, dim, list(sizes), group)
