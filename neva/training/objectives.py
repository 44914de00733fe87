"""What a step optimizes, behind two small protocols the engine calls without knowing what they compute.

- The head objective (``HeadObjective``): what a micro-batch's LM-head logits become, summed, and what the step
  divides it by (``model.loss_normalization=global_tokens``: the count over the global batch). Token cross-entropy
  (``TokenCrossEntropy``) by default; the preference stage's DPO objective (``neva.training.dpo``) is the other.
- Auxiliary objectives (``AuxObjective``): terms added to it and metrics, at three points of a step. MoE's router
  losses (``moe_loss.MoEAuxLoss``) are one; the preference objective is one too (its reference forward in
  ``prepare``, its rewards as metrics).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from neva.data.micro_batch import MicroBatch
from neva.families import part
from neva.models.loss import count_learned_tokens, summed_cross_entropy, token_cross_entropy
from neva.stages import stage_spec
from neva.training.moe_loss import MoEAuxLoss


class HeadObjective(Protocol):
    # ``loss`` is right on a context-parallel shard of a micro-batch (its rank's share of every row's tokens).
    context_parallel: bool

    def count(self, batch: MicroBatch) -> torch.Tensor:
        """What ``loss`` is a sum over, counted on the host labels (the engine sums it over micro-batches and
        data-parallel ranks: the step's divisor)."""
        ...

    def loss(self, logits: torch.Tensor, batch: MicroBatch, device: torch.device) -> torch.Tensor:
        """The micro-batch's summed loss from its logits: ``[N, V]`` at ``batch.output_positions``, or ``[B, S, V]``
        at every position (TP layouts, vocab-sharded under ``loss_parallel``)."""
        ...


class TokenCrossEntropy:
    """The default head objective: next-token cross-entropy summed over learned tokens."""

    context_parallel = True  # each cp rank sums its own learned tokens (the engine sums over dp x cp)

    def count(self, batch: MicroBatch) -> torch.Tensor:
        return count_learned_tokens(batch.labels)

    def loss(self, logits: torch.Tensor, batch: MicroBatch, device: torch.device) -> torch.Tensor:
        if logits.dim() == 3:
            if batch.next_labels is not None:  # a context-parallel shard: each position's own target
                return token_cross_entropy(logits, batch.next_labels.to(device), shifted=True)[0]
            return token_cross_entropy(logits, batch.labels.to(device))[0]
        return summed_cross_entropy(logits.float(), batch.targets.to(device, non_blocking=True))


class AuxObjective(Protocol):
    # The metrics the progress bar shows beside the loss (DPO: the rewards' accuracy and margin); the rest go to
    # metrics.csv / TensorBoard only.
    headline: tuple[str, ...]

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        """``batch`` with what the model needs for this objective (MoE: the routers' ``token_mask``); called on every
        micro-batch before the model runs, again after the engine reshapes one (joined rows)."""
        ...

    def take(self, divisor: int) -> torch.Tensor:
        """The term of the forward just run, ``/ divisor`` (micro-batches × data-parallel ranks): the engine adds it
        to the micro-batch's weighted loss before backward. Under pipeline parallelism the engine does not call it:
        an objective adds its term in each stage's own backward."""
        ...

    def step_values(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """At the end of a step: (``total``, this rank's step objective, with the objective's share added where the
        micro-batches' losses did not carry it; this rank's values ``[n]`` that sum over data-parallel ranks). The
        engine sums every objective's values and the total in one all-reduce."""
        ...

    def metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's metrics (device tensors, read when logged) from the values summed over data-parallel ranks."""
        ...

    def held_out_values(self, device: torch.device) -> torch.Tensor | None:
        """This rank's values ``[n]`` of the validation forwards run since the last call, that sum over data-parallel
        ranks (``metrics`` turns them into the held-out metrics, logged as ``val_<name>``); None: the objective
        reports nothing held out. Called on every rank after each validation."""
        ...


def aux_objectives(
    parts: list[nn.Module], layout: Any, pp_group: Any, cp_group: Any = None
) -> tuple[AuxObjective, ...]:
    """This rank's auxiliary objectives for its model ``parts`` (empty for a dense model without one)."""
    return tuple(o for o in (MoEAuxLoss.of(parts, layout, pp_group, cp_group),) if o is not None)


def stage_objective(cfg: Any) -> Any:
    """The run's stage objective (its spec's ``objective``: a head objective that is also an auxiliary one, and
    may ``attach_reference``), or None where the stage learns by token cross-entropy."""
    stage = stage_spec(cfg.stage)
    return None if stage.objective is None else part(stage.objective)(cfg)
