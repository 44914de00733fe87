"""Context parallelism over linear-attention layers: the state passed from chunk to chunk of a row, exactly.

Under context parallelism (``neva.models.context_shard``) a rank holds two chunks of every row (Megatron's load
balance: chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp`` equal ones). A Gated DeltaNet layer needs, for each chunk, the
convolution's last ``K − 1`` inputs of the chunk before it and the recurrent state at its start. Both are passed in
row order through one all-gather each (``ContextShard.gather``, differentiable):

- the convolution: every rank gathers every chunk's last ``K − 1`` inputs and prepends its chunks' predecessors';
- the state: the delta rule is linear in its starting state ``S_in``, so each rank runs its chunks once from zero
  (outputs ``O₀``, end state ``F``) and once from the identity with zero values (``Q`` ``[L, dk]`` per head and the
  transition ``M`` ``[dk, dk]``): ``O = O₀ + Q·S_in`` and ``S_out = F + M·S_in``. Every rank gathers every chunk's
  ``(F, M)``, composes them in row order from a zero state (``2·cp`` small products) and takes its chunks' ``S_in``.

Packed samples restart inside a chunk as in one process (``PackedRows``: a sample that starts in the chunk resets
the state and makes ``Q`` and ``M`` zero from there; the convolution's taps stop at its start). Cost per layer and
rank: the rule twice over its ``2 · S / (2·cp)`` columns (the second with ``dk`` values), the same on every rank
(the work is linear in the columns, so the chunks balance exactly), and ``2·cp`` chunks' ``(K − 1)·C`` inputs and
``Hv·dk·(dv + dk)`` state numbers gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from neva.models.attention import segment_runs
from neva.models.context_shard import ContextShard
from neva.models.packed_rows import PackedRows


@dataclass
class RecurrentShard:
    """This rank's chunks of every row, as rows of their own.

    ``length``: columns per chunk; ``index`` ``[n]``: each local chunk's place in the row (local order);
    ``order``: the gathered chunks (rank-major) in row order; ``packed``: the chunk rows' runs (``B · n`` rows, batch
    row major); ``taps`` ``[K − 1, B · n, K − 1 + length]``: the convolution's taps over the predecessor's last inputs
    and the chunk."""

    shard: ContextShard
    length: int
    index: torch.Tensor
    order: torch.Tensor
    packed: PackedRows
    taps: torch.Tensor

    @staticmethod
    def of(shard: ContextShard, kernel: int, device: torch.device) -> RecurrentShard:
        # Chunks: the longest length dividing every rank's runs of consecutive columns (two of a rank's chunks may
        # be neighbours in the row: cp=2's rank 1 holds chunks 1 and 2).
        # Every rank's columns, rank-major, as integers: no tensor op on them (under the fake-tensor rehearsal one
        # would lose their values).
        if shard.every is None:
            raise ValueError("a linear-attention layer under context parallelism needs the shard's columns (every)")
        held = shard.every.tolist()
        per_rank = len(held) // shard.size
        length = math.gcd(
            *(n for r in range(shard.size) for n in _run_lengths(held[r * per_rank : (r + 1) * per_rank]))
        )
        columns = shard.columns.tolist()
        chunks = [(i, columns[i], columns[i] + length) for i in range(0, len(columns), length)]
        seg = shard.segment_ids
        b, total = seg.shape
        rows, taps = [], torch.zeros(kernel - 1, b * len(chunks), kernel - 1 + length, dtype=torch.bool)
        for r, runs in enumerate(segment_runs(seg)):
            starts = torch.zeros(total, dtype=torch.long)
            for s, e in runs:
                starts[s:e] = s
            for i, (_, g0, g1) in enumerate(chunks):
                rows.append([(max(s, g0) - g0, min(e, g1) - g0, s >= g0) for s, e in runs if s < g1 and e > g0])
                cols = torch.arange(g0, g1)
                for j in range(kernel - 1):
                    taps[j, r * len(chunks) + i, kernel - 1 :] = cols - j - 1 >= starts[g0:g1]
        every = [c // length for c in held[::length]]  # every rank's chunks, rank-major, as row-order chunk indices
        return RecurrentShard(
            shard,
            length,
            torch.tensor([g0 // length for _, g0, _ in chunks], device=device),
            torch.tensor(sorted(range(len(every)), key=every.__getitem__), device=device),
            PackedRows.from_runs(rows, length, kernel, device),
            taps.to(device),
        )

    @property
    def chunks(self) -> int:
        return self.index.numel()

    def gather_chunks(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, n, ...]`` this rank's chunks → ``[B, 2·cp, ...]`` every chunk, in row order."""
        full = self.shard.gather(t, 1, [self.chunks] * self.shard.size)
        return full.index_select(1, self.order)

    def previous(self, every: torch.Tensor) -> torch.Tensor:
        """``[B, 2·cp, ...]`` (row order) → ``[B, n, ...]``: the chunk before each of this rank's (zeros before the
        first)."""
        padded = torch.cat([torch.zeros_like(every[:, :1]), every], dim=1)
        return padded.index_select(1, self.index)

    def starting_states(self, end: torch.Tensor, transition: torch.Tensor) -> torch.Tensor:
        """Each local chunk's starting state ``[B, n, H, dk, dv]`` from every rank's chunks' zero-start end states
        ``end`` and transitions ``transition`` (``[B, n, H, dk, dv]``, ``[B, n, H, dk, dk]``, this rank's)."""
        dv = end.shape[-1]
        both = self.gather_chunks(torch.cat([end, transition], dim=-1))
        state = torch.zeros_like(both[:, 0, ..., :dv])
        starts = []
        for c in range(both.shape[1]):
            starts.append(state)
            state = both[:, c, ..., :dv] + both[:, c, ..., dv:] @ state
        return torch.stack(starts, dim=1).index_select(1, self.index)


def _run_lengths(columns: list[int]) -> list[int]:
    """Lengths of the runs of consecutive values in ``columns``."""
    out, start = [], 0
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i] != columns[i - 1] + 1:
            out.append(i - start)
            start = i
    return out
