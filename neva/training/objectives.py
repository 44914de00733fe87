"""Auxiliary objectives: terms a step's objective adds to the token cross-entropy, behind one small protocol.

The engine holds this rank's objectives (none for a dense model) and calls each the same way at three points of a
step; it knows nothing of what they compute. MoE's router losses (``moe_loss.MoEAuxLoss``) are one today; DPO's
reference terms would be another.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from neva.training.moe_loss import MoEAuxLoss


class AuxObjective(Protocol):
    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
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


def aux_objectives(parts: list[nn.Module], layout: Any, pp_group: Any) -> tuple[AuxObjective, ...]:
    """This rank's auxiliary objectives for its model ``parts`` (empty for a dense model without one)."""
    return tuple(o for o in (MoEAuxLoss.of(parts, layout, pp_group),) if o is not None)
