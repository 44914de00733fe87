"""One pass over one blend source, as indices into it: a record set's permutation, or its shards in a permutation
with each shard's samples in shard order (or through a bounded shuffle buffer). Everything is seeded by
``(seed, epoch, *salt)``, so a pass is a pure function of those.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SourceLayout = int | Sequence[int]
"""A blend source as the order sees it: a record set of that many samples, or the sample counts of its shards."""


def source_size(source: SourceLayout) -> int:
    return int(source) if isinstance(source, (int, np.integer)) else int(np.sum(source, dtype=np.int64))


def buffered_permutation(n: int, buffer: int, rng: np.random.Generator) -> np.ndarray:
    """The order a shuffle buffer of ``buffer`` items gives ``0..n-1`` (a pure function of ``rng``'s state).

    The buffer fills with the first items; each later item replaces a uniformly chosen buffered one, which is
    emitted; the rest drain in random order. Items move at most ``buffer`` places earlier, so reads stay local.
    """
    if buffer <= 1 or n <= 1:
        return np.arange(n)
    size = min(buffer, n)
    buf = list(range(size))
    out = []
    # The buffer stays full while items arrive, so every pick is uniform on [0, size): draw them all at once.
    for item, pick in zip(range(size, n), rng.integers(0, size, n - size).tolist()):
        out.append(buf[pick])
        buf[pick] = item
    out.extend(buf[i] for i in rng.permutation(size).tolist())
    return np.asarray(out, dtype=np.int64)


def _shards_in_order(counts: np.ndarray, shard_order: np.ndarray) -> np.ndarray:
    """Every sample of the shards ``shard_order`` names, shard after shard, each in shard order (vectorised: no
    Python loop over shards, which is what a million shards cost before)."""
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    lengths = counts[shard_order]
    starts_out = np.cumsum(lengths, dtype=np.int64) - lengths
    # sample t of the pass is the shard's start plus how far t is past that shard's first output position
    return np.repeat(offsets[shard_order] - starts_out, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def source_stream(source: SourceLayout, seed: int, epoch: int, salt: Sequence[int], buffer: int) -> np.ndarray:
    """One pass over a blend source, as indices into it.

    Record sets: a permutation. Shards: the shards in a permutation, each one's samples in shard order or through
    ``buffered_permutation`` (seeded per shard by ``(seed, epoch, *salt, shard)``).
    """
    key = [seed, epoch, *salt]
    rng = np.random.default_rng(key)
    if isinstance(source, (int, np.integer)):
        return rng.permutation(int(source))
    counts = np.asarray(source, dtype=np.int64).reshape(-1)
    shard_order = rng.permutation(len(counts))
    if buffer <= 1:
        return _shards_in_order(counts, shard_order)
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    parts = [
        offsets[s] + buffered_permutation(int(counts[s]), buffer, np.random.default_rng([*key, s]))
        for s in shard_order.tolist()
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
