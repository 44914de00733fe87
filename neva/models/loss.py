"""Token cross-entropy, computed outside the model (pipeline stages and vocab-parallel heads need it there)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neva.constants import IGNORE_INDEX

# How a step's summed token losses become its objective (``model.loss_normalization``):
#   global_tokens     sum over every learned token of the global batch / their number (neva's default: gradient
#                     accumulation and every layout then equal one process running the whole batch);
#   micro_batch_mean  each micro-batch's mean over its own learned tokens, averaged over the micro-batches and the
#                     data-parallel ranks (HF Trainer + DDP/DeepSpeed as LLaVA ran, and NeMo NeVA): a token of a
#                     micro-batch with few learned tokens weighs more. Use it to reproduce their loss curves.
LOSS_NORMALIZATIONS = ("global_tokens", "micro_batch_mean")


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of learned tokens.

    Labels are aligned with the inputs (HF convention); the shift happens here: logits at position t predict the
    label at t + 1. Summing (not averaging) lets callers normalise by the learned tokens of the whole global batch,
    which makes gradient accumulation and every parallel layout compute the same update.

    Args:
        logits: ``[B, S, V]`` in any dtype (upcast to fp32 here).
        labels: ``[B, S]`` with ``IGNORE_INDEX`` (-100) where nothing is learned.
        shifted: ``labels`` are already what each position predicts (label t is the target of logits t): a
            context-parallel shard, whose columns are not contiguous, carries them so.

    Returns:
        ``(loss_sum, n_tokens)`` as 0-dim tensors.
    """
    shift_logits = (logits if shifted else logits[:, :-1]).float()
    shift_labels = (labels if shifted else labels[:, 1:]).to(logits.device)
    loss_sum = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (shift_labels != IGNORE_INDEX).sum()


# Rows of logits per pass of ``summed_cross_entropy``: a few MiB at Llama's 32000 classes, so the passes over a chunk
# (max, exp, sum, normalise) find it in cache.
_CE_CHUNK_ROWS = 64


class _SummedCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, in the same pass over the logits, its gradient ``softmax - one_hot``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The gradient overwrites the logits (``summed_cross_entropy`` consumes them): no second [N, V] buffer, whose
        # fresh pages alone cost about a third of F.cross_entropy's time at the benchmark's 137 MB.
        grad = logits.detach()
        total = logits.new_zeros((), dtype=torch.float32)
        for start in range(0, logits.shape[0], _CE_CHUNK_ROWS):
            end = start + _CE_CHUNK_ROWS
            g, t = grad[start:end], targets[start:end, None]
            peak = g.amax(dim=1, keepdim=True)
            total += (peak - g.gather(1, t)).sum()
            g.sub_(peak).exp_()
            norm = g.sum(dim=1, keepdim=True)
            total += norm.log().sum()
            g.div_(norm).scatter_add_(1, t, torch.full(t.shape, -1.0, dtype=g.dtype))
        ctx.save_for_backward(grad)
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.used:
            raise RuntimeError("summed_cross_entropy: its backward scales the saved gradient in place and runs once")
        ctx.used = True
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_out), None


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits, targets, reduction="sum")`` for fp32 ``[N, V]`` logits whose every target counts
    (no ignore index): the LM head's loss at learned positions. **Consumes ``logits``**: they are overwritten with
    the loss's gradient (pass logits nothing else reads; an autograd node that saved them would fail loudly).

    ``F.cross_entropy`` passes over the ``[N, V]`` logits about eight times between forward and backward
    (log-softmax, a zero-filled gradient, the backward's second exp) and allocates two more ``[N, V]`` buffers; here
    the softmax gradient is made in the forward, chunk by chunk while the rows are in cache, in the logits' own
    memory, and backward scales it in place: under half the time on the CPU benchmark. Equal to float rounding (the
    gradient is closer to a float64 reference).
    """
    if logits.dtype != torch.float32:
        raise TypeError(f"summed_cross_entropy takes fp32 logits, got {logits.dtype}")
    return _SummedCrossEntropy.apply(logits, targets)


def count_learned_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens ``token_cross_entropy`` will learn from in ``labels`` (the first position is never a target)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def micro_batch_weight(
    normalization: str, labels: torch.Tensor, global_tokens: torch.Tensor, micro_batches: int, dp_size: int
) -> torch.Tensor:
    """The factor of one micro-batch's summed token loss in the step objective (``LOSS_NORMALIZATIONS``).

    Args:
        normalization: one of ``LOSS_NORMALIZATIONS``.
        labels: the micro-batch's labels (its own learned tokens, for ``micro_batch_mean``).
        global_tokens: learned tokens of the whole global batch, all data-parallel ranks.
        micro_batches: micro-batches of this rank in the step (gradient accumulation).
        dp_size: data-parallel ranks.

    A micro-batch without a learned token has weight 0 under ``micro_batch_mean`` (HF's mean would be NaN there).
    """
    if normalization == "global_tokens":
        return 1.0 / global_tokens.clamp(min=1.0)
    if normalization == "micro_batch_mean":
        own = count_learned_tokens(labels).to(global_tokens.device, torch.float32)
        return 1.0 / (own.clamp(min=1.0) * (micro_batches * dp_size))
    raise ValueError(f"loss normalization {normalization!r}; choose one of {LOSS_NORMALIZATIONS}")


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
