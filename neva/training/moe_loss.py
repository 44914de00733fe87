"""The MoE routers' share of a step's objective and their metrics (an ``objectives.AuxObjective``).

Each micro-batch's forward leaves every MoE layer's ``RoutingStats``; ``take`` turns them into that micro-batch's
router objective (``neva.models.moe.aux_objective``: coefficient × load-balancing loss + coefficient × z-loss) and
weights it ``1 / (micro-batches × data-parallel ranks)``: the step's router term is the mean over all micro-batches
of the global batch, as Megatron-Core scales it (its aux-loss gradient is ``1 / (num_micro_batches × dp)``, with or
without its per-token loss). The load-balancing loss is a statistic of a micro-batch's routing (fractions of its
tokens), not a sum over tokens, so neva's token normalisation of the cross-entropy (``model.loss_normalization``)
does not apply to it; for a fixed global batch and micro-batch size the term is the same in every layout.
``train_loss`` is cross-entropy plus this term; ``moe_aux_loss`` is the term alone.

Under context parallelism a micro-batch's rows are split over the cp ranks: each layer's statistics are summed over
them first (differentiably), so the term is the one-process micro-batch's, and each cp rank adds ``1 / cp`` of it
(the step objective and gradients are summed over dp × cp): counted once.

Which tokens count: every real token of the micro-batch, image and prompt tokens included; padding does not (the
collator's ``segment_ids`` 0), whether the batch is padded, packed or joined into one row.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from neva.data.micro_batch import MicroBatch
from neva.models.moe import MoEFeedForward, RoutingStats, aux_objective
from neva.parallel.context_parallel import all_reduce_sum

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _WithAux(torch.autograd.Function):
    """Identity on a pipeline stage's output whose backward also starts the backward of the stage's router objective
    with gradient ``scale`` (Megatron-Core's ``MoEAuxLossAutoScaler``): the objective's gradient reaches the stage's
    routers without the objective travelling to the last stage."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_shape, ctx.scale = aux.shape, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full(ctx.aux_shape, ctx.scale, dtype=torch.float32), None


class MoEAuxLoss:
    """The routers' objective of this rank's MoE layers: ``prepare``, ``take``, ``step_values``, ``metrics``."""

    headline = ()  # per-layer loads: too many for the bar

    def __init__(self, layers: list[MoEFeedForward], layer_ids: list[int], cfg: Any, num_layers: int) -> None:
        self.layers = layers
        self._row = {id(m): i for m, i in zip(layers, layer_ids)}  # the model's layer index of each MoE layer
        self.cfg = cfg
        self.num_layers = num_layers
        # One (objective, loads of every layer [num_layers, E]) entry per forward that took the objective.
        self._entries: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._expected = 0  # under PP: the entries a step keeps (its last ones), else 0 (all)
        self.pp_group = None
        self.cp_group, self.cp = None, 1  # context parallelism: the ranks sharing each micro-batch's rows

    @classmethod
    def of(cls, parts: list[nn.Module], layout: Any, pp_group: Any = None, cp_group: Any = None) -> MoEAuxLoss | None:
        """The helper for this rank's parts, or None for a dense model. Under pipeline parallelism (``pp_group``)
        each chunk adds its own layers' objective in its own backward (``attach_to_chunks``): the ``megatron``
        formula is a sum over layers, so the stages' shares add up to the whole model's (``hf``'s pooled one is
        refused under PP, ``expert_parallel.check_expert_parallel_layout``)."""
        named = [(n, m) for part in parts for n, m in part.named_modules() if isinstance(m, MoEFeedForward)]
        if not named:
            return None
        ids = [int(_LAYER.search(n).group(1)) for n, _ in named]
        aux = cls([m for _, m in named], ids, parts[0].cfg.llm, parts[0].cfg.llm.num_layers)
        if layout.cp > 1:
            aux.cp_group, aux.cp = cp_group, layout.cp
        if layout.pp > 1:
            aux.attach_to_chunks(parts, layout, pp_group)
        return aux

    def attach_to_chunks(self, parts: list[nn.Module], layout: Any, pp_group: Any) -> None:
        """Each chunk's forward (with autograd on: training, not evaluation) takes its layers' objective, weighted
        ``1 / (micro-batches x dp)``, and hands it to backward through its output with the engine's gradient factor
        dp. The schedule's set-up forward of a new shape (on placeholder activations, never backpropagated) is
        dropped: a step keeps its last micro-batches x chunks entries."""
        self.pp_group = pp_group
        self._expected = layout.grad_accum * len(parts)
        divisor = layout.grad_accum * layout.dp
        for part in parts:
            layers = [m for m in part.modules() if isinstance(m, MoEFeedForward)]

            def hook(module, args, out, layers=layers):
                if not torch.is_grad_enabled() or not layers:
                    return out
                term = self._take(layers, divisor)
                return _WithAux.apply(out, term, float(layout.dp_cp)) if term.requires_grad else out

            part.register_forward_hook(hook)

    @staticmethod
    def prepare(batch: MicroBatch) -> MicroBatch:
        """``batch`` with the routers' ``token_mask`` (real tokens: ``segment_ids`` != 0)."""
        seg = batch.segment_ids
        return batch if seg is None else batch.with_(token_mask=seg != 0)

    def _take(self, layers: list[MoEFeedForward], divisor: int) -> torch.Tensor:
        """``layers``' router objective of this forward / ``divisor``, recorded with their loads for the metrics."""
        stats = [m.routing for m in layers]
        if self.cp_group is not None:
            stats = self._summed_over_cp(stats)
        counts = torch.stack([s.counts for s in stats])
        term = aux_objective(stats, self.cfg)
        term = counts.new_zeros(()) if term is None else term / (divisor * self.cp)
        counts = counts / self.cp  # summed over dp × cp with the step's values: each micro-batch's loads once
        loads = counts.new_zeros((self.num_layers, counts.shape[1]))
        loads[[self._row[id(m)] for m in layers]] = counts
        self._entries.append((term.detach(), loads))
        for m in layers:
            m.routing = None  # the graph it holds is freed with this step's backward
        return term

    def _summed_over_cp(self, stats: list[RoutingStats]) -> list[RoutingStats]:
        """Each layer's statistics of the whole micro-batch: the cp ranks' sums added up (one collective)."""
        parts = [t.reshape(-1) for s in stats for t in (s.counts, s.prob_sum, s.z_sum, s.tokens)]
        summed = all_reduce_sum(torch.cat(parts), self.cp_group).split([p.numel() for p in parts])
        out = []
        for i, s in enumerate(stats):
            counts, prob_sum, z_sum, tokens = summed[4 * i : 4 * i + 4]
            out.append(replace(s, counts=counts.detach(), prob_sum=prob_sum, z_sum=z_sum[0], tokens=tokens[0].detach()))
        return out

    def take(self, divisor: int) -> torch.Tensor:
        """This forward's router objective (every MoE layer of the rank) / ``divisor``."""
        return self._take(self.layers, divisor)

    def step_values(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rank's step objective, [the routers' objective, loads of every layer flattened]).

        ``total`` includes the routers' objective, except under PP, where it is the cross-entropy alone (already
        summed over the stages) and each stage's objective and loads (its own layers' rows) are summed over the
        stages here."""
        entries, self._entries = self._entries[-self._expected :], []
        routers = torch.cat(
            [torch.stack([e[0] for e in entries]).sum().float().reshape(1), sum(e[1] for e in entries).flatten()]
        )
        if self.pp_group is not None:
            dist.all_reduce(routers, group=self.pp_group)
            total = total + routers[0]
        return total, routers

    def metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """``moe_aux_loss`` (the routers' term) and each layer's min / max share of the expert load."""
        counts = values[1:].view(self.num_layers, -1)
        share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0)
        lo, hi = share.min(dim=1).values, share.max(dim=1).values
        metrics = {"moe_aux_loss": values[0]}
        for layer in range(self.num_layers):
            metrics[f"moe_load_min_layer{layer}"] = lo[layer]
            metrics[f"moe_load_max_layer{layer}"] = hi[layer]
        return metrics

    def held_out_values(self, device: torch.device) -> None:
        """The routers' terms are a training objective: nothing held out."""
        return None
