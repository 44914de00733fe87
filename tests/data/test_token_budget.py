"""Micro-batches filled to a token budget (``neva.data.token_budget``): each step trains the fixed sampler's global
batch, every micro-batch within the budget, every rank as many micro-batches, and the state resumes at the next
step under any data-parallel size."""

from __future__ import annotations

import numpy as np
import pytest

from neva.data.sampler import ResumableBatchSampler
from neva.data.token_budget import TokenBudgetBatchSampler, micro_batch_cost

N, MBS, GBS, BUDGET = 96, 2, 12, 300
TOKENS = np.random.default_rng(0).integers(20, 200, N)  # one sample up to ~10x another


def samplers(dp: int, packed: bool = False, patches=None, **base):
    return [
        TokenBudgetBatchSampler(
            ResumableBatchSampler([N], MBS, r, dp, seed=3, accumulation=GBS // (MBS * dp), **base),
            TOKENS,
            BUDGET,
            packed,
            multiple=8,
            patches=patches,
        )
        for r in range(dp)
    ]


def steps_of(sampler) -> list[list[list[int]]]:
    """The sampler's micro-batches grouped by the step they close, as the training loop receives them."""
    steps, step = [], []
    for indices in sampler:
        sampler.advance(1)
        step.append(indices)
        if sampler.closes_step:
            steps.append(step)
            step = []
    assert not step
    return steps


@pytest.mark.parametrize("packed", [False, True])
def test_each_step_is_the_fixed_global_batch_within_the_budget(packed):
    order = ResumableBatchSampler([N], MBS, 0, 2, seed=3, accumulation=GBS // (MBS * 2)).order(0)
    step = GBS
    ranks = [steps_of(s) for s in samplers(2, packed)]
    assert len(ranks[0]) == N // step
    counts = []
    for k, per_rank in enumerate(zip(*ranks)):
        assert len(per_rank[0]) == len(per_rank[1])  # every rank runs as many forwards
        counts.append(len(per_rank[0]))
        got = sorted(i for micro in per_rank for mb in micro for i in mb)
        assert got == sorted(order[k * step : (k + 1) * step].tolist())
        shares = [sum(len(mb) for mb in micro) for micro in per_rank]
        assert shares == [step // 2] * 2  # a rank's share of samples is the fixed one's
        for micro in per_rank:
            for mb in micro:
                assert len(mb) == 1 or micro_batch_cost(TOKENS[mb].tolist(), packed, 8) <= BUDGET
    assert len(set(counts)) > 1  # the number of micro-batches varies from step to step


def test_ranks_balanced_by_work_with_patches():
    patches = np.random.default_rng(1).integers(0, 400, N)
    for r0, r1 in zip(*(steps_of(s) for s in samplers(2, patches=patches))):
        work = [sum(int(TOKENS[i] + patches[i]) for mb in micro for i in mb) for micro in (r0, r1)]
        assert max(work) <= 1.3 * min(work)


def test_resume_at_the_next_step_under_another_data_parallel_size():
    first = samplers(2)
    (whole,) = [steps_of(s) for s in samplers(1)]
    for s in first:  # two steps taken at dp 2
        it = iter(s)
        while True:
            next(it)
            s.advance(1)
            if s.closes_step and s.consumed == 2 * s.step_samples:
                break
    state = first[0].state_dict()
    resumed = samplers(1)[0]
    resumed.load_state_dict(state)
    assert resumed.steps_left() == len(whole) - 2
    rest = steps_of(resumed)
    assert [sorted(i for mb in step for i in mb) for step in rest] == [
        sorted(i for mb in step for i in mb) for step in whole[2:]
    ]
