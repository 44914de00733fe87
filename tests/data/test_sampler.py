"""Deterministic, data-parallel, resumable sampling; blends; modality/length grouping."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from neva.data.sampler import (
    ResumableBatchSampler,
    blend_order,
    group_by_length,
    group_by_modality_length,
    split_to_even_chunks,
)


def test_deterministic_and_partitioned_across_ranks():
    samplers = [ResumableBatchSampler([103], 4, r, 3, seed=5) for r in range(3)]
    batches = [list(s) for s in samplers]
    assert all(len(b) == 103 // 12 for b in batches)
    seen = [i for b in batches for mb in b for i in mb]
    assert len(seen) == len(set(seen)) == (103 // 12) * 12
    assert batches[0] == list(ResumableBatchSampler([103], 4, 0, 3, seed=5))
    assert batches[0] != list(ResumableBatchSampler([103], 4, 0, 3, seed=6))
    first_epoch = batches[0]
    samplers[0].advance(len(first_epoch))
    # An exhausted epoch reports the next one's length (a trainer asks len() before iterating the next epoch).
    assert len(samplers[0]) == len(first_epoch)
    assert list(samplers[0]) != first_epoch  # next epoch: new permutation
    assert samplers[0].epoch == 1


@pytest.mark.parametrize("new_world", [2, 1])
def test_resume_at_exact_next_sample(new_world):
    full = ResumableBatchSampler([50], 2, 0, 2, seed=1)
    order = full.order(0)
    s = ResumableBatchSampler([50], 2, 0, 2, seed=1)
    it = iter(s)
    for _ in range(3):
        next(it)
        s.advance()
    state = s.state_dict()
    assert state["consumed_samples"] == 12
    ranks = [ResumableBatchSampler([50], 2, r, new_world, seed=1) for r in range(new_world)]
    for r in ranks:
        r.load_state_dict(state)
    nxt = [i for r in ranks for i in next(iter(r))]
    assert nxt == order[12 : 12 + 2 * new_world].tolist()


def test_seed_change_refused():
    s = ResumableBatchSampler([10], 2, seed=1)
    with pytest.raises(ValueError, match="seed"):
        ResumableBatchSampler([10], 2, seed=2).load_state_dict(s.state_dict())


def test_blend_follows_weights():
    order = blend_order([100, 1000], [0.5, 0.5], seed=0, epoch=0)
    assert len(order) == 1100
    counts = Counter(int(i >= 100) for i in order)
    assert counts[0] == counts[1] == 550  # small set upsampled, large one subsampled
    first = order[order < 100][:100]
    assert sorted(first.tolist()) == list(range(100))  # a whole pass before repeating
    assert (blend_order([100, 1000], [0.5, 0.5], 0, 0) == order).all()


def test_group_by_length():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(5, 500, 200) * rng.choice([-1, 1], 200)]
    order = group_by_length(np.arange(200), lengths, 8, seed=0, epoch=0)
    assert sorted(order.tolist()) == list(range(200))
    groups = order[: (200 // 8) * 8].reshape(-1, 8)
    signs = np.sign(np.asarray(lengths)[groups])
    full = [g for g, sg in zip(groups, signs) if len(set(sg.tolist())) == 1]
    assert len(full) >= len(groups) - 2  # all but the leftovers are single-modality


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="global batch"):
        ResumableBatchSampler([3], 2, 0, 2)


def test_epochs_hold_whole_optimizer_steps():
    s = ResumableBatchSampler([112], 16, seed=0)  # 7 micro-batches of 16
    s.accumulation = 2
    assert len(s) == s.num_steps == 6  # the 7th would be a half step, never consumed by a trainer
    s.advance(len(list(s)))
    assert len(s) == 6 and s.epoch == 0
    next(iter(s))
    assert s.epoch == 1


def llava_split_to_even_chunks(indices, lengths, num_chunks):
    """LLaVA's ``split_to_even_chunks`` (llava/train/llava_trainer.py), transcribed as the oracle."""
    if len(indices) % num_chunks != 0:
        return [indices[i::num_chunks] for i in range(num_chunks)]
    num_indices_per_chunk = len(indices) // num_chunks
    chunks = [[] for _ in range(num_chunks)]
    chunks_lengths = [0 for _ in range(num_chunks)]
    for index in indices:
        shortest_chunk = chunks_lengths.index(min(chunks_lengths))
        chunks[shortest_chunk].append(index)
        chunks_lengths[shortest_chunk] += lengths[index]
        if len(chunks[shortest_chunk]) == num_indices_per_chunk:
            chunks_lengths[shortest_chunk] = float("inf")
    return chunks


def _llava_lengths(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(5, 500, n) * np.where(rng.random(n) < 0.2, -1, 1)]  # ~20 % text-only


def test_llava_modality_grouping_has_llavas_properties():
    """Batches of one modality, random contents (not length-sorted), lengths balanced over the micro-batches of each
    global batch exactly as LLaVA's ``split_to_even_chunks`` deals them; a mixed tail as in LLaVA."""
    n, mbs, chunks = 1000, 4, 4  # global batch 16: e.g. DP 2 × accumulation 2
    lengths = np.asarray(_llava_lengths(n))
    order = np.random.default_rng(5).permutation(n)
    grouped = group_by_modality_length(order, lengths, mbs, chunks, seed=0, epoch=0)
    assert sorted(grouped.tolist()) == list(range(n))
    gbs = mbs * chunks
    image, text = order[lengths[order] > 0], order[lengths[order] < 0]
    tail = len(image) % gbs or gbs
    tail += len(text) % gbs or gbs
    body = grouped[: n - tail].reshape(-1, gbs)
    slices = {
        frozenset(p[i : i + gbs].tolist()): p[i : i + gbs].tolist()
        for p in (image, text)
        for i in range(0, len(p), gbs)
    }
    for batch in body:
        signs = set(np.sign(lengths[batch]).tolist())
        assert len(signs) == 1  # one modality
        drawn = slices[frozenset(batch.tolist())]  # contents: consecutive draws of the modality's random order
        longest_first = sorted(drawn, key=lambda i: abs(lengths[i]), reverse=True)  # LLaVA's (stable) sort
        expected = llava_split_to_even_chunks(longest_first, np.abs(lengths).tolist(), chunks)
        assert batch.tolist() == [i for c in expected for i in c]  # micro-batch k = LLaVA's chunk k
    assert grouped[n - tail :].tolist() == sorted(grouped[n - tail :].tolist())  # LLaVA's tail: sorted by index
    # Contents random: the spread of lengths inside a batch is that of the whole modality, not of a length bucket
    # (neva's group_by_length sorts 8 global batches, so its batches are narrow).
    image_lengths = lengths[lengths > 0]
    spread = np.mean([np.std(lengths[b]) for b in body if lengths[b[0]] > 0])
    assert spread > 0.8 * np.std(image_lengths)
    sorted_order = group_by_length(order, lengths, gbs, seed=0, epoch=0)
    narrow = np.mean([np.std(lengths[b]) for b in sorted_order[: (n // gbs) * gbs].reshape(-1, gbs)])
    assert narrow < 0.3 * np.std(image_lengths)
    # Totals across the micro-batches of a global batch are balanced (LLaVA's purpose): far closer than a random split.
    totals = [np.abs(lengths[b]).reshape(chunks, mbs).sum(1) for b in body]
    assert np.mean([t.max() - t.min() for t in totals]) < 0.25 * np.mean([t.mean() for t in totals])


def test_split_to_even_chunks_is_llavas():
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 100, 40)
    for num_chunks in (1, 3, 4, 7):
        indices = rng.permutation(40)[:36].tolist()
        assert split_to_even_chunks(indices, sizes, num_chunks) == llava_split_to_even_chunks(
            indices, sizes.tolist(), num_chunks
        )


@pytest.mark.parametrize("new_world", [2, 1])
def test_llava_grouped_sampler_resumes_at_exact_next_sample(new_world):
    """Same state and rank rule as ungrouped sampling; the grouping depends on the global and micro-batch sizes, not
    on how the global batch is split over data-parallel ranks and accumulation."""
    lengths = _llava_lengths(150, seed=3)
    full = ResumableBatchSampler([150], 2, 0, 2, seed=1, lengths=lengths, accumulation=2)
    order = full.order(0)
    one = ResumableBatchSampler([150], 2, 0, 1, seed=1, lengths=lengths, accumulation=4)
    assert (one.order(0) == order).all()
    s = ResumableBatchSampler([150], 2, 0, 2, seed=1, lengths=lengths, accumulation=2)
    it = iter(s)
    for _ in range(6):
        next(it)
        s.advance()
    state = s.state_dict()
    ranks = [
        ResumableBatchSampler([150], 2, r, new_world, seed=1, lengths=lengths, accumulation=4 // new_world)
        for r in range(new_world)
    ]
    for r in ranks:
        r.load_state_dict(state)
    nxt = [i for r in ranks for i in next(iter(r))]
    assert nxt == order[24 : 24 + 2 * new_world].tolist()


def test_both_groupings_refused():
    from neva.data.config import DataConfig

    with pytest.raises(ValueError, match="choose one"):
        DataConfig(group_by_modality_length=True, group_by_length=True)
