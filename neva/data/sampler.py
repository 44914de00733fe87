"""Deterministic, resumable, data-parallel batch sampling with blends, LLaVA's modality grouping and neva's length
grouping.

The global sample order of an epoch is a pure function of ``(seed, epoch)``. Global batches are consecutive slices
of ``micro_batch_size × dp_world`` samples; data-parallel rank r takes the r-th micro-batch of each slice (tensor
and pipeline ranks of a replica pass the same ``dp_rank`` and so see the same batch). The state is the epoch and
the number of samples (all ranks together) already handed to the training loop, so a resumed run continues with
the exact next sample, even under a different data-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from neva.data.patch_balance import balance_patches


def blend_choices(weights: Sequence[float], total: int) -> np.ndarray:
    """Megatron's deterministic blend: which dataset each of ``total`` draws comes from.

    Draw i goes to the dataset furthest behind its target share ``w_d · (i + 1)`` (ties: the first).
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    out = np.empty(total, dtype=np.int64)
    for i in range(total):
        d = max(range(len(w)), key=lambda j: w[j] * (i + 1) - counts[j])
        counts[d] += 1
        out[i] = d
    return out


def interleave(sizes: Sequence[int], choices: np.ndarray, stream: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """Indices into the concatenation of datasets of ``sizes``: draw i takes the next index of dataset ``choices[i]``.

    Dataset d walks through ``stream(d, 0)``, then ``stream(d, 1)``... (indices into it, a new pass each time one is
    used up), so small datasets are upsampled and large ones subsampled.

    Raises:
        ValueError: a dataset that is drawn from but has no samples.
    """
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    order = np.empty(len(choices), dtype=np.int64)
    for d, size in enumerate(sizes):
        positions = np.flatnonzero(choices == d)
        if len(positions) == 0:
            continue
        if size == 0:
            raise ValueError(f"blend source {d} has weight but no samples")
        passes = np.concatenate([stream(d, c) for c in range(-(-len(positions) // size))])
        order[positions] = offsets[d] + passes[: len(positions)]
    return order


def blend_order(sizes: Sequence[int], weights: Sequence[float] | None, seed: int, epoch: int) -> np.ndarray:
    """Indices into the concatenation of datasets of ``sizes``, one epoch of ``sum(sizes)`` draws.

    Without weights: a permutation of everything. With weights: ``blend_choices``, each dataset walking through its
    own permutations (``interleave``).
    """
    total = int(sum(sizes))
    if weights is None:
        return np.random.default_rng([seed, epoch]).permutation(total)
    return interleave(
        sizes,
        blend_choices(weights, total),
        lambda d, cycle: np.random.default_rng([seed, epoch, d, cycle]).permutation(sizes[d]),
    )


def split_to_even_chunks(indices: Sequence[int], sizes: np.ndarray, num_chunks: int) -> list[list[int]]:
    """LLaVA's ``split_to_even_chunks``: deal ``indices`` (longest first) to ``num_chunks`` equal-sized chunks, each
    to the chunk of least total size so far (a full chunk takes no more); strided when they do not divide evenly."""
    indices = [int(i) for i in indices]
    if len(indices) % num_chunks != 0:
        return [indices[i::num_chunks] for i in range(num_chunks)]
    per_chunk = len(indices) // num_chunks
    chunks: list[list[int]] = [[] for _ in range(num_chunks)]
    totals = [0.0] * num_chunks
    for index in indices:
        shortest = totals.index(min(totals))
        chunks[shortest].append(index)
        totals[shortest] += float(sizes[index])
        if len(chunks[shortest]) == per_chunk:
            totals[shortest] = float("inf")
    return chunks


def _balanced_megabatches(part: np.ndarray, sizes: np.ndarray, micro_batch_size: int, num_chunks: int) -> list:
    """LLaVA's ``get_length_grouped_indices`` after its random permutation (``part``): megabatches of
    ``micro_batch_size × num_chunks`` consecutive samples, each sorted longest first and split into ``num_chunks``
    micro-batches of balanced total length."""
    mega = micro_batch_size * num_chunks
    out = []
    for start in range(0, len(part), mega):
        block = part[start : start + mega]
        block = block[np.argsort(-sizes[block], kind="stable")]
        out.append(np.asarray([i for c in split_to_even_chunks(block, sizes, num_chunks) for i in c], dtype=np.int64))
    return out


def group_by_modality_length(
    order: np.ndarray, lengths: Sequence[int], micro_batch_size: int, num_chunks: int, seed: int, epoch: int
) -> np.ndarray:
    """LLaVA's ``get_modality_length_grouped_indices`` (``llava/train/llava_trainer.py``) over an existing order.

    ``lengths`` are signed (negative = text-only). Each modality's samples, in ``order`` (LLaVA: a random
    permutation), are cut into megabatches of one global batch (``micro_batch_size × num_chunks``, ``num_chunks`` =
    data-parallel size × accumulation, LLaVA's ``world_size × gradient_accumulation_steps``); inside one, the samples
    are dealt longest first to the ``num_chunks`` micro-batches so that their total lengths balance (rank r of
    micro-step k gets micro-batch ``k·dp + r``, as HF's sharded batch sampler hands them out). The megabatches of both
    modalities except each one's last are shuffled together; the two last ones follow as one tail sorted by index
    (mixed, up to two global batches; the sampler drops a partial one). So every global batch but the tail is one
    modality, its contents a random draw (not length-sorted: only the split across micro-batches depends on length).
    When only one modality is present there is no tail: the megabatches stay in ``order``'s order.
    """
    lengths = np.asarray(lengths)
    sizes = np.abs(lengths)
    image = lengths[order] > 0
    if image.all() or not image.any():
        parts = _balanced_megabatches(order, sizes, micro_batch_size, num_chunks)
        return np.concatenate(parts) if parts else order[:0]
    mm = _balanced_megabatches(order[image], sizes, micro_batch_size, num_chunks)
    lang = _balanced_megabatches(order[~image], sizes, micro_batch_size, num_chunks)
    tail = np.sort(np.concatenate([mm[-1], lang[-1]]), kind="stable")
    whole = mm[:-1] + lang[:-1]
    rng = np.random.default_rng([seed, epoch, 7])
    return np.concatenate([*(whole[i] for i in rng.permutation(len(whole))), tail])


def group_by_length(
    order: np.ndarray, lengths: Sequence[int], group_size: int, seed: int, epoch: int, megabatch_factor: int = 8
) -> np.ndarray:
    """neva's length grouping (``model.data.group_by_length``), for throughput rather than fidelity to LLaVA.

    ``lengths`` are signed (negative = text-only). Each modality's samples (in ``order``) are cut into megabatches of
    ``group_size × megabatch_factor``, sorted by length (longest first) inside, and cut into groups of
    ``group_size`` (one global batch); the groups of both modalities are then shuffled together. Every global batch
    is therefore one modality and similar lengths (less padding), but its contents are length-correlated across 8
    global batches, unlike LLaVA's. Leftover partial groups go last.
    """
    lengths = np.asarray(lengths)
    rng = np.random.default_rng([seed, epoch, 7])
    groups, leftovers = [], []
    for mask in (lengths[order] > 0, lengths[order] <= 0):
        part = order[mask]
        mega = group_size * megabatch_factor
        for start in range(0, len(part), mega):
            chunk = part[start : start + mega]
            chunk = chunk[np.argsort(-np.abs(lengths[chunk]), kind="stable")]
            for g in range(0, len(chunk), group_size):
                group = chunk[g : g + group_size]
                (groups if len(group) == group_size else leftovers).append(group)
    groups = [groups[i] for i in rng.permutation(len(groups))]
    parts = groups + leftovers
    return np.concatenate(parts) if parts else order[:0]


GROUPINGS = ("modality_length", "length")


class ResumableBatchSampler:
    """Yields this rank's micro-batches of dataset indices; resumable at the exact next sample.

    Args:
        sizes: length of each blended dataset (one entry when not blending).
        micro_batch_size: samples per micro-batch on each rank.
        dp_rank: this rank's data-parallel index.
        dp_world: data-parallel size.
        seed: base seed; the epoch's order depends on ``(seed, epoch)`` only.
        weights: blend weights (``concat_sampling_probabilities``) or None.
        shuffle: False gives the datasets in order (validation).
        lengths: signed modality lengths for grouping (None = no grouping).
        grouping: with ``lengths``: ``modality_length`` (LLaVA's, ``group_by_modality_length``) or ``length``
            (neva's, ``group_by_length``).
        accumulation: micro-batches per optimizer step (each epoch holds whole steps only).
        patches: a native-resolution tower's patches per sample (None: fixed-size towers, nothing re-dealt): each
            global micro-batch is re-dealt to the ranks to balance them (``neva.data.patch_balance``).

    Raises:
        ValueError: the samples cannot fill one optimizer step (``global_batch_size`` samples): nothing would train.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
        weights: Sequence[float] | None = None,
        shuffle: bool = True,
        lengths: Sequence[int] | None = None,
        accumulation: int = 1,
        grouping: str = "modality_length",
        patches: Sequence[int] | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} outside data-parallel size {dp_world}")
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping {grouping!r}; choose one of {GROUPINGS}")
        self.grouping = grouping
        self.sizes = list(sizes)
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.weights = None if weights is None else list(weights)
        self.shuffle = shuffle
        self.lengths = lengths
        self.patches = None if patches is None else np.asarray(patches, dtype=np.int64)
        self.epoch = 0
        self.consumed = 0  # samples of this epoch handed to the training loop, all ranks together
        self.closes_step = False  # the last micro-batch handed over was an optimizer step's last (``advance``)
        # Micro-batches per optimizer step. An epoch holds whole steps only: a trainer ends its epoch after the last
        # whole step, so a leftover micro-batch would never be consumed and the next epoch would never start.
        self.accumulation = accumulation
        if self.num_steps == 0:
            raise ValueError(
                f"{sum(self.sizes)} samples cannot fill one global batch of {self.global_batch * accumulation} "
                f"(model.global_batch_size = micro_batch_size {micro_batch_size} × data-parallel {dp_world} × "
                f"accumulation {accumulation}): nothing would train; give more data or a smaller global batch"
            )

    @property
    def global_batch(self) -> int:
        """Samples per step, all data-parallel ranks together."""
        return self.micro_batch_size * self.dp_world

    @property
    def num_steps(self) -> int:
        """Full global micro-batches per epoch, a multiple of ``accumulation`` (partial ones are dropped so that all
        ranks step together)."""
        return sum(self.sizes) // (self.global_batch * self.accumulation) * self.accumulation

    def __len__(self) -> int:
        """Micro-batches the next ``__iter__`` yields: the rest of this epoch, or a whole new one when it is done."""
        consumed = self.consumed if self.consumed < self.num_steps * self.global_batch else 0
        return self.num_steps - consumed // self.global_batch

    def order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch``."""
        if not self.shuffle:
            order = np.arange(sum(self.sizes))
        else:
            order = blend_order(self.sizes, self.weights, self.seed, epoch)
        if self.lengths is None:
            return order
        if self.grouping == "modality_length":
            chunks = self.dp_world * self.accumulation
            return group_by_modality_length(order, self.lengths, self.micro_batch_size, chunks, self.seed, epoch)
        return group_by_length(order, self.lengths, self.global_batch * self.accumulation, self.seed, epoch)

    def __iter__(self) -> Iterator[list[int]]:
        if self.consumed >= self.num_steps * self.global_batch:
            self.epoch, self.consumed = self.epoch + 1, 0
        order = self.order(self.epoch)
        usable = self.num_steps * self.global_batch
        start = self.consumed
        mbs = self.micro_batch_size
        for pos in range(start, usable - self.global_batch + 1, self.global_batch):
            chunk = order[pos : pos + self.global_batch]
            if self.patches is not None:
                chunk = balance_patches(chunk, self.patches, self.dp_world)
            yield [int(i) for i in chunk[self.dp_rank * mbs : (self.dp_rank + 1) * mbs]]

    def advance(self, steps: int = 1) -> None:
        """Record that ``steps`` global batches reached the training loop (``closes_step``: the last one was an
        optimizer step's last)."""
        self.consumed += steps * self.global_batch
        self.closes_step = self.consumed % (self.global_batch * self.accumulation) == 0

    def steps_left(self) -> int:
        """Optimizer steps the next ``__iter__`` yields."""
        return len(self) // self.accumulation

    def state_dict(self) -> dict[str, Any]:
        """Epoch, samples consumed in it, and the seed (checked on load)."""
        return {"epoch": self.epoch, "consumed_samples": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken."""
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"data seed changed from {state['seed']} to {self.seed}; the sample order would differ")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed_samples"])
