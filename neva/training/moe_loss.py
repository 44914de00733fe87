"""The MoE routers' share of a step's objective and their metrics (``Engine``'s helper for MoE models).

Each micro-batch's forward leaves every MoE layer's ``RoutingStats``; ``take`` turns them into that micro-batch's
router objective (``neva.models.moe.aux_objective``: coefficient × load-balancing loss + coefficient × z-loss) and
weights it ``1 / (micro-batches × data-parallel ranks)``: the step's router term is the mean over all micro-batches
of the global batch, as Megatron-Core scales it (its aux-loss gradient is ``1 / (num_micro_batches × dp)``, with or
without its per-token loss). The load-balancing loss is a statistic of a micro-batch's routing (fractions of its
tokens), not a sum over tokens, so neva's token normalisation of the cross-entropy (``model.loss_normalization``)
does not apply to it; for a fixed global batch and micro-batch size the term is the same in every layout.
``train_loss`` is cross-entropy plus this term; ``moe_aux_loss`` is the term alone.

Which tokens count: every real token of the micro-batch, image and prompt tokens included; padding does not (the
collator's ``segment_ids`` 0), whether the batch is padded, packed or joined into one row.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from neva.models.moe import MoEFeedForward, aux_objective

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
    def __init__(self, layers: list[nn.Module], layer_ids: list[int], cfg: Any, num_layers: int) -> None:
        self.layers = layers
        self.layer_ids = layer_ids
        self.cfg = cfg
        self.num_layers = num_layers
        self._aux = None
        self._counts = None
        # Pipeline parallelism: one (objective, loads) entry per chunk forward, and the pipeline group.
        self._entries: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._expected = 0
        self.pp_group = None

    @classmethod
    def of(cls, parts: list[nn.Module], layout: Any, pp_group: Any = None) -> MoEAuxLoss | None:
        """The helper for this rank's parts, or None for a dense model. Under pipeline parallelism (``pp_group``)
        each chunk adds its own layers' objective in its own backward (``attach_to_chunks``): the ``megatron``
        formula is a sum over layers, so the stages' shares add up to the whole model's (``hf``'s pooled one is
        refused under PP, ``expert_parallel.check_expert_parallel_layout``)."""
        named = [(n, m) for part in parts for n, m in part.named_modules() if isinstance(m, MoEFeedForward)]
        if not named:
            return None
        ids = [int(_LAYER.search(n).group(1)) for n, _ in named]
        aux = cls([m for _, m in named], ids, parts[0].cfg.llm, parts[0].cfg.llm.num_layers)
        if layout.pp > 1:
            aux.attach_to_chunks(parts, layout, pp_group)
        return aux

    def attach_to_chunks(self, parts: list[nn.Module], layout: Any, pp_group: Any) -> None:
        """Each chunk's forward (with autograd on: training, not evaluation) takes its layers' objective, weighted
        ``1 / (micro-batches x dp)``, and hands it to backward through its output with the engine's gradient factor
        dp. The schedule's set-up forward of a new shape (on placeholder activations, never backpropagated) is
        dropped: a step keeps its last micro-batches x chunks entries."""
        self.pp_group = pp_group
        layer_of = {id(m): i for m, i in zip(self.layers, self.layer_ids)}
        self.layer_ids = list(range(self.num_layers))  # loads of every layer, summed over the stages
        self._expected = layout.grad_accum * len(parts)
        divisor = layout.grad_accum * layout.dp
        for part in parts:
            layers = [m for m in part.modules() if isinstance(m, MoEFeedForward)]
            rows = [layer_of[id(m)] for m in layers]  # the model's layer ids

            def hook(module, args, out, layers=layers, rows=rows):
                if not torch.is_grad_enabled() or not layers:
                    return out
                term, counts = self._take(layers, divisor)
                full = counts.new_zeros((self.num_layers, counts.shape[1]))
                full[rows] = counts
                self._entries.append((term.detach(), full))
                if term.requires_grad:
                    out = _WithAux.apply(out, term, float(layout.dp))
                return out

            part.register_forward_hook(hook)

    @staticmethod
    def with_token_mask(batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with the routers' ``token_mask`` (real tokens: ``segment_ids`` != 0)."""
        seg = batch.get("segment_ids")
        return batch if seg is None else {**batch, "token_mask": seg != 0}

    def _take(self, layers: list[MoEFeedForward], divisor: int) -> tuple[torch.Tensor, torch.Tensor]:
        stats = [m.routing for m in layers]
        counts = torch.stack([s.counts for s in stats])
        term = aux_objective(stats, self.cfg)
        term = counts.new_zeros(()) if term is None else term / divisor
        for m in layers:
            m.routing = None  # the graph it holds is freed with this step's backward
        return term, counts

    def take(self, divisor: int) -> torch.Tensor:
        """This forward's router objective / ``divisor``, accumulating it and the expert loads for the metrics."""
        term, counts = self._take(self.layers, divisor)
        self._aux = term.detach() if self._aux is None else self._aux + term.detach()
        self._counts = counts if self._counts is None else self._counts + counts
        return term

    def step_total(self, total: torch.Tensor, dp_group: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the step objective summed over data-parallel ranks, the step's MoE metrics); one all-reduce for all.

        Under PP ``total`` is the cross-entropy alone, already summed over the stages; each stage's objective and
        loads (its own layers' rows) are summed over the stages first."""
        if self.pp_group is not None:
            entries, self._entries = self._entries[-self._expected :], []
            self._aux = torch.stack([e[0] for e in entries]).sum()
            self._counts = torch.stack([e[1] for e in entries]).sum(0)
        routers = torch.cat([self._aux.float().reshape(1), self._counts.flatten()])
        if self.pp_group is not None:
            dist.all_reduce(routers, group=self.pp_group)
        flat = torch.cat([total.reshape(1), routers])
        if dp_group is not None:
            dist.all_reduce(flat, group=dp_group)
        counts = flat[2:].view_as(self._counts)
        share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0)
        lo, hi = share.min(dim=1).values, share.max(dim=1).values
        # tensors on the device: the caller reads them when it logs (no host sync here; the rehearsal has no values)
        metrics = {"moe_aux_loss": flat[1]}
        for i, layer in enumerate(self.layer_ids):
            metrics[f"moe_load_min_layer{layer}"] = lo[i]
            metrics[f"moe_load_max_layer{layer}"] = hi[i]
        self._aux = self._counts = None
        objective = flat[0] + flat[1] if self.pp_group is not None else flat[0]
        return objective, metrics
