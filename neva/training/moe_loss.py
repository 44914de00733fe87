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
from neva.typed import ConfigError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class MoEAuxLoss:
    def __init__(self, layers: list[nn.Module], layer_ids: list[int], cfg: Any) -> None:
        self.layers = layers
        self.layer_ids = layer_ids
        self.cfg = cfg
        self._aux = None
        self._counts = None

    @classmethod
    def of(cls, parts: list[nn.Module], layout: Any) -> MoEAuxLoss | None:
        """The helper for this rank's parts, or None for a dense model.

        Raises:
            ConfigError: an MoE model under pipeline parallelism (its routers' objective is not yet carried across
                stages).
        """
        named = [(n, m) for part in parts for n, m in part.named_modules() if isinstance(m, MoEFeedForward)]
        if not named:
            return None
        if layout.pp > 1:
            raise ConfigError(
                "num_moe_experts with model.pipeline_model_parallel_size > 1 is not supported yet: the routers' "
                "load-balancing objective is not carried across pipeline stages"
            )
        ids = [int(_LAYER.search(n).group(1)) for n, _ in named]
        return cls([m for _, m in named], ids, parts[0].cfg.llm)

    @staticmethod
    def with_token_mask(batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with the routers' ``token_mask`` (real tokens: ``segment_ids`` != 0)."""
        seg = batch.get("segment_ids")
        return batch if seg is None else {**batch, "token_mask": seg != 0}

    def take(self, divisor: int) -> torch.Tensor:
        """This forward's router objective / ``divisor``, accumulating it and the expert loads for the metrics."""
        stats = [m.routing for m in self.layers]
        counts = torch.stack([s.counts for s in stats])
        term = aux_objective(stats, self.cfg)
        term = counts.new_zeros(()) if term is None else term / divisor
        self._aux = term.detach() if self._aux is None else self._aux + term.detach()
        self._counts = counts if self._counts is None else self._counts + counts
        for m in self.layers:
            m.routing = None  # the graph it holds is freed with this step's backward
        return term

    def step_total(self, total: torch.Tensor, dp_group: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """(the step objective summed over data-parallel ranks, the step's MoE metrics); one all-reduce for all."""
        flat = torch.cat([total.reshape(1), self._aux.float().reshape(1), self._counts.flatten()])
        if dp_group is not None:
            dist.all_reduce(flat, group=dp_group)
        counts = flat[2:].view_as(self._counts)
        share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0)
        lo, hi = share.min(dim=1).values.tolist(), share.max(dim=1).values.tolist()
        metrics = {"moe_aux_loss": flat[1].item()}
        for i, layer in enumerate(self.layer_ids):
            metrics[f"moe_load_min_layer{layer}"] = lo[i]
            metrics[f"moe_load_max_layer{layer}"] = hi[i]
        self._aux = self._counts = None
        return flat[0], metrics
