"""The streaming sample order over ``.tar`` shards (and record sets blended with them), and its resumable sampler.

Each epoch visits the shards of a source in a permutation of ``(seed, epoch)`` and the samples of a shard in shard
order (or through a bounded, seeded shuffle buffer), so reads move through one shard at a time
(``neva.data.shards.ShardDataset`` reads them). The batches go through ``ResumableBatchSampler``'s rank rule and state
unchanged, so DataLoader workers (which receive whole micro-batches, in order) and the exact-resume accounting of
``ResumableLoader`` work as they do for JSON data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from neva.data.sampler import ResumableBatchSampler, blend_choices, interleave
from neva.data.shards import ShardDataset

SourceLayout = int | Sequence[int]
"""A blend source as the order sees it: a record set of that many samples, or the sample counts of its shards."""


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


def source_stream(source: SourceLayout, seed: int, epoch: int, salt: Sequence[int], buffer: int) -> np.ndarray:
    """One pass over a blend source, as indices into it.

    Record sets: a permutation. Shards: the shards in a permutation, each one's samples in shard order or through
    ``buffered_permutation``. Everything is seeded by ``(seed, epoch, *salt)``.
    """
    key = [seed, epoch, *salt]
    rng = np.random.default_rng(key)
    if isinstance(source, (int, np.integer)):
        return rng.permutation(int(source))
    counts = [int(c) for c in source]
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    parts = []
    for s in rng.permutation(len(counts)).tolist():
        within = buffered_permutation(counts[s], buffer, np.random.default_rng([*key, s]))
        parts.append(offsets[s] + within)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _size(source: SourceLayout) -> int:
    return int(source) if isinstance(source, (int, np.integer)) else int(sum(source))


def stream_order(
    sources: Sequence[SourceLayout], weights: Sequence[float] | None, seed: int, epoch: int, buffer: int = 0
) -> np.ndarray:
    """The epoch's global order over the concatenation of ``sources`` (``sum`` of their sizes draws).

    One source: its ``source_stream``. Several: each draw takes the next sample of the source chosen by
    ``blend_choices`` (weights None = proportional to size), each source walking through its own streams, a new
    one each time it is used up (small sources upsampled, large ones subsampled, as ``blend_order``).

    Raises:
        ValueError: a source with weight but no samples.
    """
    sizes = [_size(s) for s in sources]
    if len(sources) == 1:
        return source_stream(sources[0], seed, epoch, (0, 0), buffer)
    total = sum(sizes)
    w = [s / total for s in sizes] if weights is None else list(weights)
    return interleave(
        sizes, blend_choices(w, total), lambda d, cycle: source_stream(sources[d], seed, epoch, (d, cycle), buffer)
    )


class StreamingBatchSampler(ResumableBatchSampler):
    """``ResumableBatchSampler`` (same rank rule, same state) over ``stream_order`` instead of a global permutation.

    A resumed sampler starts at sample ``consumed`` of the epoch's order; the dataset is only asked for the samples
    from there on, so shards already finished are never opened.

    Args:
        sources: per blend source, its record count or its shards' sample counts.
        micro_batch_size / dp_rank / dp_world / seed / weights / accumulation: as ``ResumableBatchSampler``.
        shuffle_buffer: ``model.data.shard_shuffle_buffer``.
    """

    def __init__(
        self,
        sources: Sequence[SourceLayout],
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
        weights: Sequence[float] | None = None,
        shuffle_buffer: int = 0,
        accumulation: int = 1,
    ) -> None:
        super().__init__(
            [_size(s) for s in sources], micro_batch_size, dp_rank, dp_world, seed, weights=weights,
            accumulation=accumulation,
        )  # fmt: skip
        self.sources = [s if isinstance(s, (int, np.integer)) else list(s) for s in sources]
        self.shuffle_buffer = shuffle_buffer
        self._cached: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch`` (computed once per epoch: a blend costs a pass over the draws)."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, stream_order(self.sources, self.weights, self.seed, epoch, self.shuffle_buffer))
        return self._cached[1]

    def state_dict(self) -> dict[str, Any]:
        """As ``ResumableBatchSampler``, plus the shuffle buffer (checked on load)."""
        return {**super().state_dict(), "shard_shuffle_buffer": self.shuffle_buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken.

        Raises:
            ValueError: the seed or the shuffle buffer changed (the order would differ).
        """
        buffer = state.get("shard_shuffle_buffer", self.shuffle_buffer)
        if buffer != self.shuffle_buffer:
            raise ValueError(
                f"model.data.shard_shuffle_buffer changed from {buffer} to {self.shuffle_buffer}; "
                "the sample order would differ"
            )
        super().load_state_dict(state)


def source_layout(dataset: Dataset) -> SourceLayout:
    """What ``stream_order`` needs to know about one train dataset."""
    return dataset.layout() if isinstance(dataset, ShardDataset) else len(dataset)
