"""The streaming order: one shard at a time, seeded by (seed, epoch), local shuffle buffer."""

from __future__ import annotations

import numpy as np

from neva.data.stream_sampler import buffered_permutation, stream_order


def test_order_properties():
    counts = [5, 3, 4]
    order = stream_order([counts], None, seed=1, epoch=0)
    assert sorted(order.tolist()) == list(range(12))
    offsets = [0, 5, 8]
    shard_of = np.searchsorted(offsets, order, side="right") - 1
    runs = [int(s) for i, s in enumerate(shard_of) if i == 0 or s != shard_of[i - 1]]
    assert sorted(runs) == [0, 1, 2]  # one shard at a time
    assert (stream_order([counts], None, 1, 0) == order).all()
    assert not (stream_order([counts], None, 1, 1) == order).all()
    perm = buffered_permutation(50, 4, np.random.default_rng(0))
    assert sorted(perm.tolist()) == list(range(50)) and (perm != np.arange(50)).any()
    assert all(p <= i + 4 for i, p in enumerate(perm.tolist()))  # a sample is read at most 4 places early
