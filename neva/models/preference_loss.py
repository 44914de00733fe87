"""Preference objectives (DPO and its variants) on per-sequence log-probabilities, outside the model.

Every objective is a function of ``h = (π_c − π_r) − (ref_c − ref_r)``, the policy's log-ratio of the chosen over the
rejected reply minus the reference's (Rafailov et al. 2023). One table row per objective, each TRL's
``DPOTrainer.dpo_loss`` formula (docs/TRAINING.md, "Preference optimization"):

    sigmoid  −(1−ε)·logσ(βh) − ε·logσ(−βh)                DPO; ε = label smoothing (cDPO), 0 by default
    robust   (−(1−ε)·logσ(βh) + ε·logσ(−βh)) / (1 − 2ε)     robust DPO (Chowdhury et al. 2024), unbiased under noise ε
    hinge    relu(1 − βh)                                   SLiC (Zhao et al. 2023)
    ipo      (h − 1/(2β))²                                  IPO (Azar et al. 2023); its log-probs are token means
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _sigmoid(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -F.logsigmoid(beta * h) * (1 - eps) - F.logsigmoid(-beta * h) * eps


def _robust(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (-F.logsigmoid(beta * h) * (1 - eps) + F.logsigmoid(-beta * h) * eps) / (1 - 2 * eps)


def _hinge(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return torch.relu(1 - beta * h)


def _ipo(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (h - 1 / (2 * beta)) ** 2


# name -> (per-pair loss of h, whether its sequence log-probs are means over the reply's tokens (IPO) or sums)
PREFERENCE_LOSSES: dict[str, tuple[Callable[[torch.Tensor, float, float], torch.Tensor], bool]] = {
    "sigmoid": (_sigmoid, False),
    "robust": (_robust, False),
    "hinge": (_hinge, False),
    "ipo": (_ipo, True),
}


def pair_losses(
    loss_type: str, beta: float, label_smoothing: float, policy: torch.Tensor, reference: torch.Tensor
) -> torch.Tensor:
    """Per-pair losses ``[P]`` from sequence log-probs ``[2P]`` (chosen rows first, then the rejected ones, as the
    concatenated batch holds them) of the policy and the reference."""
    n = policy.shape[0] // 2
    h = (policy[:n] - policy[n:]) - (reference[:n] - reference[n:])
    return PREFERENCE_LOSSES[loss_type][0](h, beta, label_smoothing)


def sequence_logps(token_logps: torch.Tensor, rows: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's learned tokens ``[n_rows]``, their number ``[n_rows]``).

    ``token_logps`` ``[T]``: log-prob of each learned token; ``rows`` ``[T]``: the row it belongs to."""
    zeros = torch.zeros(n_rows, dtype=token_logps.dtype, device=token_logps.device)
    return zeros.index_add(0, rows, token_logps), zeros.index_add(0, rows, torch.ones_like(token_logps))
