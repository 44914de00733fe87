"""Native-resolution towers: the step's tower work spread evenly over data-parallel ranks.

With a native-resolution tower (Qwen-VL) a sample's tower patches follow from its images' sizes, so the micro-batches
of one global batch can differ several-fold in tower work and every rank waits for the slowest. ``balance_patches``
re-deals the samples of one global micro-batch (``micro_batch_size × dp`` consecutive samples of the epoch's order)
to the ranks, most patches first, each to the rank of least patches so far that still has room (the rule of LLaVA's
``split_to_even_chunks``, ``neva.data.sampler``, whose parts always divide evenly here), keeping the order's deal where that is as good. It only permutes inside the slice:
the set of samples a step trains on, the number consumed and so resuming (under any data-parallel size) are as
without it, and it is a pure function of the slice and the patch counts, so every rank computes the same deal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rank_patches(chunk: np.ndarray, patches: np.ndarray, ranks: int) -> np.ndarray:
    """Tower patches of each rank's micro-batch when ``chunk`` is dealt in ``ranks`` consecutive equal parts."""
    return patches[chunk].reshape(ranks, -1).sum(1)


def balance_patches(chunk: np.ndarray, patches: np.ndarray, ranks: int) -> np.ndarray:
    """``chunk`` (one global micro-batch, ``ranks`` equal parts) re-ordered so that rank r's part, the r-th, holds a
    balanced share of ``patches``; unchanged where the greedy deal's largest part is not smaller."""
    chunk = np.asarray(chunk, dtype=np.int64)
    if ranks <= 1 or len(chunk) % ranks:
        return chunk
    per_rank = len(chunk) // ranks
    parts: list[list[int]] = [[] for _ in range(ranks)]
    totals = np.zeros(ranks)
    for index in chunk[np.argsort(-patches[chunk], kind="stable")]:
        open_ranks = [r for r in range(ranks) if len(parts[r]) < per_rank]
        r = min(open_ranks, key=lambda k: totals[k])  # ties: the lowest rank
        parts[r].append(int(index))
        totals[r] += patches[index]
    dealt = np.asarray([i for part in parts for i in part], dtype=np.int64)
    if rank_patches(dealt, patches, ranks).max() < rank_patches(chunk, patches, ranks).max():
        return dealt
    return chunk


def spread(per_rank: Sequence[float]) -> tuple[float, float]:
    """(max, mean) of per-rank counts: their ratio is how long the step waits on its slowest tower."""
    values = np.asarray(per_rank, dtype=np.float64)
    return float(values.max()), float(values.mean())
