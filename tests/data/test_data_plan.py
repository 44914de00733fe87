"""The epoch's data plan (``neva.data.data_plan``, order rule 2): the vectorised streams equal the per-shard loop,
the blend equals a plain-Python reading of the rule, resume at any sample, and one shared build per job."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from neva.data.data_plan import ROUND_SALT, build_plan, shared_plan
from neva.data.source_stream import buffered_permutation, source_stream
from neva.data.stream_sampler import StreamingBatchSampler, stream_order


def reference_source_stream(source, seed, epoch, salt, buffer):
    """Rule 1's pass over one source, one shard at a time (the implementation before vectorisation)."""
    key = [seed, epoch, *salt]
    rng = np.random.default_rng(key)
    if isinstance(source, int):
        return rng.permutation(source)
    offsets = np.concatenate([[0], np.cumsum(source)])
    parts = [
        offsets[s] + buffered_permutation(source[s], buffer, np.random.default_rng([*key, s]))
        for s in rng.permutation(len(source)).tolist()
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def reference_order(sources, weights, seed, epoch, round_size):
    """Rule 2 read literally: per round, each source's share plus its carry (exact fractions), the remainder to the
    largest remainders (ties: lower index); the round's draws are each source's next ones, in the round's
    permutation."""
    sizes = [s if isinstance(s, int) else sum(s) for s in sources]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    raw = sizes if weights is None else weights
    w = [Fraction(x) / sum(Fraction(y) for y in raw) for x in raw]
    streams = [[] for _ in sources]
    taken = [0] * len(sources)
    carry = [Fraction(0)] * len(sources)
    total, out = sum(sizes), []
    for r in range(-(-total // round_size)):
        m = min(round_size, total - r * round_size)
        owed = [m * wj + c for wj, c in zip(w, carry)]
        give = [int(o) for o in owed]
        for j in sorted(range(len(w)), key=lambda j: (-(owed[j] - give[j]), j))[: m - sum(give)]:
            give[j] += 1
        carry = [o - g for o, g in zip(owed, give)]
        values = []
        for j, g in enumerate(give):
            while len(streams[j]) < taken[j] + g:
                cycle = len(streams[j]) // sizes[j]
                streams[j] += (reference_source_stream(sources[j], seed, epoch, (j, cycle), 0) + offsets[j]).tolist()
            values += streams[j][taken[j] : taken[j] + g]
            taken[j] += g
        out += [values[i] for i in np.random.default_rng([seed, epoch, ROUND_SALT, r]).permutation(m).tolist()]
    return np.asarray(out)


LAYOUTS = [[5, 3, 4], [1000, 7, 0, 250], [1] * 40, [], [9]]


@pytest.mark.parametrize("buffer", [0, 1, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vectorised_stream_equals_the_shard_by_shard_loop(layout, buffer):
    for seed, epoch, salt in ((0, 0, (0, 0)), (7, 3, (2, 5))):
        want = reference_source_stream(layout, seed, epoch, salt, buffer)
        assert source_stream(layout, seed, epoch, salt, buffer).tolist() == want.tolist()
    assert source_stream(17, 1, 2, (0, 0), 0).tolist() == reference_source_stream(17, 1, 2, (0, 0), 0).tolist()


def test_one_source_keeps_rule_1_order():
    assert (
        stream_order([[5, 3, 4]], None, 1, 0).tolist() == reference_source_stream([5, 3, 4], 1, 0, (0, 0), 0).tolist()
    )
    assert stream_order([30], None, 1, 2).tolist() == np.random.default_rng([1, 2, 0, 0]).permutation(30).tolist()


@pytest.mark.parametrize(
    ("sources", "weights", "round_size"),
    [
        ([[5, 3, 4], 10], None, 7),
        ([[5, 3, 4], 10, [2, 2]], [0.5, 0.3, 0.2], 5),  # upsampled small sources, several passes
        ([40, [1] * 9, 3], [1.0, 0.0, 3.0], 16),  # a source without weight is never drawn
        ([100, 100], [1, 2], 1 << 16),  # one round
    ],
)
def test_blend_equals_the_rule_read_literally(sources, weights, round_size):
    plan = build_plan(sources, weights, 3, 1, round_size=round_size)
    want = reference_order(sources, weights, 3, 1, round_size)
    assert plan[:].tolist() == want.tolist()
    # every slice is the same draws, whatever rounds it spans
    for a, b in ((0, 1), (3, 30), (len(want) - 4, len(want)), (round_size - 1, round_size + 2)):
        assert plan[a:b].tolist() == want[a:b].tolist()


def test_shares_stay_within_one_draw_at_every_round():
    sizes, weights = [10_000, 3_000, 50, 7_000], [0.1, 0.6, 0.05, 0.25]
    plan = build_plan([[1000] * 10, 3000, 50, [700] * 10], weights, 0, 0, round_size=256)
    drawn = plan.counts
    target = np.arange(len(drawn))[:, None] * 256 * np.asarray(weights)
    target[-1] = sum(sizes) * np.asarray(weights)
    assert np.abs(drawn - target).max() < 1
    assert (np.diff(drawn, axis=0) >= 0).all() and (drawn.sum(axis=1)[:-1] == np.arange(len(drawn) - 1) * 256).all()


def test_resume_at_a_random_sample_equals_an_uninterrupted_run():
    sources, weights = [[30, 20, 50], 64, [16] * 4], [0.2, 0.5, 0.3]

    def sampler():
        return StreamingBatchSampler(sources, micro_batch_size=2, dp_rank=1, dp_world=3, seed=5, weights=weights)

    ref = []
    for epoch in (0, 1):  # two uninterrupted epochs
        whole = sampler()
        whole.epoch = epoch
        ref += list(whole)
    steps = len(ref) // 2
    for at in np.random.default_rng(0).integers(1, 2 * steps, 5).tolist():
        first = sampler()
        it = iter(first)
        for _ in range(at % steps):
            next(it)
        first.advance(at % steps)
        first.epoch = at // steps
        resumed = sampler()
        resumed.load_state_dict(first.state_dict())
        got = list(resumed)
        assert got == ref[at : at + len(got)] and len(got) == steps - at % steps


def test_a_blend_written_under_rule_1_is_refused_and_one_source_is_not():
    blend = StreamingBatchSampler([[4, 4], 8], micro_batch_size=2)
    old = {"epoch": 0, "consumed_samples": 4, "seed": 0, "shard_shuffle_buffer": 0}  # no order_rule: rule 1
    with pytest.raises(ValueError, match="blend rule 1"):
        blend.load_state_dict(old)
    single = StreamingBatchSampler([[4, 4]], micro_batch_size=2)
    single.load_state_dict(old)
    assert single.consumed == 4


def _open(cache, out):
    out.put(shared_plan([[100] * 50, 3000, [10] * 7], [0.3, 0.3, 0.4], 9, 2, 0, cache).origin)


def test_two_ranks_read_one_cache_without_rebuilding(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_open, args=(tmp_path, out)) for _ in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(60)
    assert sorted(out.get() for _ in ranks) == ["built", "mapped"]
    mapped = shared_plan([[100] * 50, 3000, [10] * 7], [0.3, 0.3, 0.4], 9, 2, 0, tmp_path)
    assert mapped.origin == "mapped" and isinstance(mapped.streams, np.memmap)
    assert mapped[:].tolist() == stream_order([[100] * 50, 3000, [10] * 7], [0.3, 0.3, 0.4], 9, 2).tolist()
    assert sorted(p.name for p in tmp_path.iterdir() if "tmp" in p.name or p.suffix == ".lock") == []


def test_100m_samples_over_100_sources_in_seconds():
    """Half the sources shards of 1000 samples, half record sets, weighted (scripts/benchmark.py --data-plan runs
    1 B against rule 1 in the same run)."""
    per = 1_000_000
    sources = [[1000] * (per // 1000) if d % 2 else per for d in range(100)]
    weights = np.random.default_rng(0).random(100) + 0.5
    start = time.perf_counter()
    plan = build_plan(sources, weights.tolist(), 1, 0)
    took = time.perf_counter() - start
    assert len(plan) == 100 * per and took < 30
    at = 12_345_678
    assert len(set(plan[at : at + 4096].tolist())) == 4096


def test_a_new_epochs_build_drops_the_epochs_every_rank_has_left(tmp_path):
    for epoch in range(3):
        shared_plan([[5, 5], 10], None, 0, epoch, 0, tmp_path)
    kept = sorted(p.name.rsplit("-e", 1)[1] for p in tmp_path.iterdir())
    assert kept == ["1.counts.npy", "1.streams.npy", "2.counts.npy", "2.streams.npy"]


def test_benchmark_data_plan_mode_measures_both_rules():
    script = Path(__file__).resolve().parents[2] / "scripts" / "benchmark.py"
    out = subprocess.run(
        [sys.executable, str(script), "--data-plan", "--data-plan-cases", "20000x4", "--data-plan-files", "10000"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    summary = json.loads(out.strip().splitlines()[-1])
    rows = {r["impl"]: r for r in summary["rows"]}
    assert rows["rule2"]["drawn"] == rows["rule1"]["drawn"] == 20000 and rows["rule2"]["memory_mapped"]
    assert summary["speedup"]["20000x4"] > 0
