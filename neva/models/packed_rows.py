"""Packed rows for linear attention: each sample restarts the convolution and the delta rule's state.

Both run on a copy of the row in which every sample starts on a chunk boundary (``neva.models.delta_rule.CHUNK``)
after at least ``K - 1`` zeros (``PackedRows``): the convolution (one pass over the copy, ``causal_conv_last``)
reads those zeros where it reaches before a sample's start, as it reads its own zero padding for a sample alone;
the gap after a sample has ``beta = g = 0`` (the rule's gates, split into the copy), which leave the state alone,
and the state is reset at each sample's first chunk. No chunk holds two samples, so each is computed as alone, and a
row costs its tokens plus about one chunk per sample (padding every sample to the longest would cost the longest
times the samples). The gap's convolution outputs (the sample's last inputs reaching past its end) write nothing
(``beta = 0``) and are dropped by ``join``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neva.models.attention import segment_runs
from neva.models.delta_rule import CHUNK


@dataclass
class PackedRows:
    """Where each token of ``[B, S]`` packed rows sits when every run of equal segment ids starts a chunk, after at
    least ``K - 1`` zeros where another run precedes it in the row.

    ``slots`` ``[B·S]``: each token's place (row-major) in the flattened ``[B, W]`` layout (``W`` a multiple of the
    chunk); ``resets`` ``[B, W / chunk]``: chunks that start a run; ``last`` ``[B]``: the start column of each row's
    last run."""

    shape: tuple[int, int]
    width: int
    slots: torch.Tensor
    resets: torch.Tensor
    last: torch.Tensor

    @staticmethod
    def of(segment_ids: torch.Tensor, kernel: int, device: torch.device) -> PackedRows | None:
        """None where every row is one run (nothing to restart)."""
        rows = segment_runs(segment_ids.cpu())
        if all(len(r) == 1 for r in rows):
            return None
        return PackedRows.from_runs(
            [[(st, e, True) for st, e in r] for r in rows], segment_ids.shape[1], kernel, device
        )

    @staticmethod
    def from_runs(rows: list[list[tuple[int, int, bool]]], s: int, kernel: int, device: torch.device) -> PackedRows:
        """From each row's runs ``(start, end, fresh)`` (tiling its ``s`` columns); a run not ``fresh`` continues a
        state from before the row (context parallelism's chunks): its first chunk is no reset."""
        b = len(rows)

        def span(runs: list[tuple[int, int, bool]], i: int) -> int:
            """Whole chunks for run ``i`` and, unless it ends the row, the ``K - 1`` zeros after it."""
            st, e, _ = runs[i]
            return -(-(e - st + (kernel - 1 if i + 1 < len(runs) else 0)) // CHUNK) * CHUNK

        width = max(sum(span(runs, i) for i in range(len(runs))) for runs in rows)
        slots, resets = [], torch.zeros(b, width // CHUNK, dtype=torch.bool)
        for r, runs in enumerate(rows):
            at = 0
            for i, (st, e, fresh) in enumerate(runs):
                slots.extend(range(r * width + at, r * width + at + e - st))
                resets[r, at // CHUNK] = fresh
                at += span(runs, i)
        last = torch.tensor([runs[-1][0] for runs in rows])
        return PackedRows((b, s), width, torch.tensor(slots, device=device), resets.to(device), last.to(device))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` → ``[B, W, ...]`` (zeros in the gaps)."""
        flat = x.reshape(-1, *x.shape[2:])
        out = flat.new_zeros(self.shape[0] * self.width, *x.shape[2:])
        return out.index_copy(0, self.slots, flat).view(self.shape[0], self.width, *x.shape[2:])

    def join(self, y: torch.Tensor) -> torch.Tensor:
        """``[B, W, ...]`` → ``[B, S, ...]``."""
        return y.reshape(-1, *y.shape[2:]).index_select(0, self.slots).view(*self.shape, *y.shape[2:])


def causal_conv(qkv: torch.Tensor, filters: torch.Tensor, taps: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of ``qkv`` ``[N, C, L]`` by ``filters`` ``[C, 1, K]`` (zeros before the row),
    each tap ``j`` (reaching ``j + 1`` columns back) dropped where ``taps[j]`` ``[N, L]`` is False (context
    parallelism's chunks: one ``conv1d`` costs a third of the masked taps' time, so rows laid out with zeros before
    each sample, ``PackedRows``, take it)."""
    kernel = filters.shape[-1]
    if taps is None:
        return F.conv1d(F.pad(qkv, (kernel - 1, 0)), filters, groups=qkv.shape[1])
    out = qkv * filters[:, :, -1]  # the token itself: the filter's last tap (cross-correlation, as conv1d)
    for j in range(kernel - 1):
        back = F.pad(qkv, (j + 1, 0))[..., : qkv.shape[-1]] * taps[j][:, None, :]
        out = out + back * filters[:, :, kernel - 2 - j]
    return out


def causal_conv_last(x: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """``causal_conv`` of ``x`` ``[N, L, C]`` (channels last, as the projections give them) into ``[N, L, C]``.

    Plain fp32 tensors take ``_CausalConvLast``: the taps as shifted multiply-adds over ``[N, L, C]`` in memory,
    about half the time of ``conv1d`` on the transposed copy and its backward (a depthwise filter of a few taps is
    memory-bound: ``conv1d`` adds a transposed copy each way and a slow depthwise backward); sharded or low-precision
    inputs take ``conv1d`` (which accumulates each output's taps before one rounding)."""
    if type(x) is torch.Tensor and type(filters) is torch.Tensor and x.dtype == filters.dtype == torch.float32:
        return _CausalConvLast.apply(x, filters)
    return causal_conv(x.transpose(1, 2), filters).transpose(1, 2)


class _CausalConvLast(torch.autograd.Function):
    """``out[t] = sum_j filters[:, 0, j] * x[t - (K - 1 - j)]`` (zeros before the row), channels last."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
        kernel, length = filters.shape[-1], x.shape[1]
        taps = filters[:, 0, :].t()  # [K, C]
        out = x * taps[kernel - 1]
        for j in range(max(kernel - 1 - length, 0), kernel - 1):  # the taps that reach inside the row
            back = kernel - 1 - j  # columns before the output's
            out[:, back:].addcmul_(x[:, : length - back], taps[j])
        ctx.save_for_backward(x, taps)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, taps = ctx.saved_tensors
        kernel, length = taps.shape[0], x.shape[1]
        grad_x, grad_taps = grad * taps[kernel - 1], torch.zeros_like(taps)
        grad_taps[kernel - 1] = (x * grad).sum((0, 1))
        for j in range(max(kernel - 1 - length, 0), kernel - 1):
            back = kernel - 1 - j
            grad_x[:, : length - back].addcmul_(grad[:, back:], taps[j])
            grad_taps[j] = (x[:, : length - back] * grad[:, back:]).sum((0, 1))
        return grad_x, grad_taps.t()[:, None, :]
