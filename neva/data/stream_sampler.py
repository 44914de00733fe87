"""The streaming sample order over ``.tar`` shards (and record sets blended with them), and its resumable sampler.

Each epoch visits the shards of a source in a permutation of ``(seed, epoch)`` and the samples of a shard in shard
order (or through a bounded, seeded shuffle buffer), so reads move through one shard at a time
(``neva.data.shards.ShardDataset`` reads them). The batches go through ``ResumableBatchSampler``'s rank rule and state
unchanged, so DataLoader workers (which receive whole micro-batches, in order) and the exact-resume accounting of
``ResumableLoader`` work as they do for JSON data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from neva.data.data_plan import ORDER_RULE, EpochPlan, build_plan, shared_plan
from neva.data.sampler import ResumableBatchSampler
from neva.data.shards import ShardDataset
from neva.data.source_stream import SourceLayout, buffered_permutation, source_size, source_stream

__all__ = ["StreamingBatchSampler", "buffered_permutation", "source_layout", "source_stream", "stream_order"]


def stream_order(
    sources: Sequence[SourceLayout], weights: Sequence[float] | None, seed: int, epoch: int, buffer: int = 0
) -> np.ndarray:
    """The epoch's global order over the concatenation of ``sources`` (``sum`` of their sizes draws), in memory.

    One source: its ``source_stream``. Several: order rule 2 of ``neva.data.data_plan`` (weights None =
    proportional to size; small sources upsampled, large ones subsampled).

    Raises:
        ValueError: a source with weight but no samples.
    """
    return build_plan(sources, weights, seed, epoch, buffer)[:]


class StreamingBatchSampler(ResumableBatchSampler):
    """``ResumableBatchSampler`` (same rank rule, same state) over ``stream_order`` instead of a global permutation.

    A resumed sampler starts at sample ``consumed`` of the epoch's order; the dataset is only asked for the samples
    from there on, so shards already finished are never opened.

    Args:
        sources: per blend source, its record count or its shards' sample counts.
        micro_batch_size / dp_rank / dp_world / seed / weights / accumulation: as ``ResumableBatchSampler``.
        shuffle_buffer: ``model.data.shard_shuffle_buffer``.
        plan_dir: where the epoch's plan is written once and memory-mapped by every rank
            (``neva.data.data_plan.shared_plan``); None: each rank builds it in memory.
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
        plan_dir: str | Path | None = None,
    ) -> None:
        super().__init__(
            [source_size(s) for s in sources], micro_batch_size, dp_rank, dp_world, seed, weights=weights,
            accumulation=accumulation,
        )  # fmt: skip
        self.sources = [s if isinstance(s, (int, np.integer)) else list(s) for s in sources]
        self.shuffle_buffer = shuffle_buffer
        self.plan_dir = plan_dir
        self._cached: EpochPlan | None = None

    def order(self, epoch: int) -> EpochPlan:
        """The global sample order of ``epoch``, read by slices (planned once per epoch)."""
        if self._cached is None or self._cached.epoch != epoch:
            args = (self.sources, self.weights, self.seed, epoch, self.shuffle_buffer)
            self._cached = build_plan(*args) if self.plan_dir is None else shared_plan(*args, self.plan_dir)
        return self._cached

    def state_dict(self) -> dict[str, Any]:
        """As ``ResumableBatchSampler``, plus the shuffle buffer and the order rule (checked on load)."""
        return {**super().state_dict(), "shard_shuffle_buffer": self.shuffle_buffer, "order_rule": ORDER_RULE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken.

        Raises:
            ValueError: the seed or the shuffle buffer changed, or a blend's state was written under another order
                rule (the order would differ).
        """
        rule = state.get("order_rule", 1)  # states without the key predate rule 2
        if len(self.sources) > 1 and rule != ORDER_RULE:
            raise ValueError(
                f"this checkpoint's data order is blend rule {rule} and this neva's is rule {ORDER_RULE} "
                "(neva/data/data_plan.py): resuming would reshuffle the rest of the epoch. Resume it with the neva "
                "that wrote it, or start the blend's epoch anew"
            )
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
