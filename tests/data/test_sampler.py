"""Deterministic, data-parallel, resumable sampling; blends; modality/length grouping."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from neva.data.sampler import ResumableBatchSampler, blend_order, group_by_modality_length


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


def test_group_by_modality_length():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(5, 500, 200) * rng.choice([-1, 1], 200)]
    order = group_by_modality_length(np.arange(200), lengths, 8, seed=0, epoch=0)
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
