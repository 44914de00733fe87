"""Token cross-entropy, computed outside the model (pipeline stages and vocab-parallel heads need it there)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neva.constants import IGNORE_INDEX


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of learned tokens.

    Labels are aligned with the inputs (HF convention); the shift happens here: logits at position t predict the
    label at t + 1. Summing (not averaging) lets callers normalise by the learned tokens of the whole global batch,
    which makes gradient accumulation and every parallel layout compute the same update.

    Args:
        logits: ``[B, S, V]`` in any dtype (upcast to fp32 here).
        labels: ``[B, S]`` with ``IGNORE_INDEX`` (-100) where nothing is learned.

    Returns:
        ``(loss_sum, n_tokens)`` as 0-dim tensors.
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:].to(logits.device)
    loss_sum = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (shift_labels != IGNORE_INDEX).sum()


def count_learned_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens ``token_cross_entropy`` will learn from in ``labels`` (the first position is never a target)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def learned_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where logits are needed and what they predict: ``(positions [N, 2] (row, column), targets [N])``.

    Position t predicts label t + 1, so t is needed iff label t + 1 is learned. Running the LM head (and the
    vocabulary-wide softmax) only there skips the prompt, image and padding positions, which are most of a LLaVA
    batch; the loss is the same as ``token_cross_entropy`` on full logits. Call it on host labels (the collator
    does): the number of positions is data-dependent, which on a device would be a sync.
    """
    next_labels = labels[:, 1:]
    positions = (next_labels != IGNORE_INDEX).nonzero()
    return positions, next_labels[positions[:, 0], positions[:, 1]]
