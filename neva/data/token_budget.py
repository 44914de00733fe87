"""Micro-batches filled to a token budget (``model.data.max_tokens_per_micro_batch``), the global batch in samples kept.

With native resolution, AnyRes tiles, many images or video one sample can be a hundred times another, so a fixed
number of samples per micro-batch either wastes the device or runs out of memory on one batch in a thousand. Here
an optimizer step still trains ``global_batch_size`` samples — the same consecutive slice of the epoch's order as
with fixed micro-batches (``neva.data.sampler.ResumableBatchSampler.order``) — but each data-parallel rank cuts its
share into as few micro-batches as fit the budget, so the number of micro-batches per step varies from step to step.
The step is the same step: under ``model.loss_normalization=global_tokens`` the loss is the sum over all learned
tokens of the global batch divided by their number, whatever the micro-batches (``neva.training.engine``).

The rule, a pure function of the step's slice and the samples' token counts, so every rank computes every rank's
deal and none needs a collective:

1. the slice is dealt to the data-parallel ranks, equal sample counts, balanced by work (a sample's decoder tokens,
   text and visual, plus a native tower's patches: the rule of ``neva.data.patch_balance``, which it replaces);
2. each rank sorts its share longest first and fills micro-batches in that order up to the budget (what a
   micro-batch costs: its padded ``rows × longest`` unpacked, its tokens packed; a sample over the budget alone);
3. every rank takes the largest count of any rank (FSDP2, expert all-to-all and pipeline stages need every rank to
   run the same number of forwards), splitting its costliest micro-batch in two until it has as many.

A step's micro-batches are consumed whole, so the resumable state stays the base sampler's: the epoch and the samples
consumed, at step boundaries (resuming under another data-parallel size, or with the budget changed or removed,
continues at the same sample).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from neva.data.collate import round_up
from neva.data.patch_balance import balance_patches
from neva.data.sampler import ResumableBatchSampler


def micro_batch_cost(lengths: Sequence[int], packed: bool, multiple: int = 1) -> int:
    """Tokens a micro-batch of samples of ``lengths`` puts through the decoder: their sum packed (rows filled, a
    joined row holds only real tokens), ``samples × longest`` (rounded up to ``multiple``) right-padded."""
    if not len(lengths):
        return 0
    if packed:
        return int(sum(lengths))
    return len(lengths) * round_up(int(max(lengths)), multiple)


def fill_to_budget(lengths: Sequence[int], budget: int, packed: bool, multiple: int = 1) -> list[list[int]]:
    """Positions ``0..n-1`` of ``lengths`` in consecutive groups, each as long as its cost stays within ``budget``
    (a sample whose cost alone is over it forms a group of its own)."""
    groups: list[list[int]] = []
    for i, n in enumerate(lengths):
        if groups and micro_batch_cost([lengths[j] for j in groups[-1]] + [n], packed, multiple) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_to(groups: list[list[int]], count: int, cost) -> list[list[int]]:
    """``groups`` with the costliest one of two or more samples halved until there are ``count`` (at most the number
    of samples), in the order the samples came."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [k for k, g in enumerate(groups) if len(g) > 1]
        k = max(splittable, key=lambda j: (cost(groups[j]), -j))
        g = groups[k]
        groups[k : k + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


def plan_step(
    chunk: np.ndarray,
    tokens: np.ndarray,
    ranks: int,
    budget: int,
    packed: bool,
    multiple: int = 1,
    patches: np.ndarray | None = None,
    min_micro_batches: int = 1,
) -> list[list[list[int]]]:
    """Every rank's micro-batches (lists of sample indices) of one step's ``chunk`` (its ``global_batch_size``
    samples, ``ranks`` equal shares)."""
    work = tokens if patches is None else tokens + patches
    dealt = balance_patches(np.asarray(chunk, dtype=np.int64), work, ranks)
    shares = dealt.reshape(ranks, -1)
    per_rank = []
    for share in shares:
        share = share[np.argsort(-tokens[share], kind="stable")]  # longest first: rows of like length pad least
        lengths = [int(tokens[i]) for i in share]
        groups = fill_to_budget(lengths, budget, packed, multiple)
        per_rank.append((share, lengths, groups))
    count = min(max(max(len(g) for _, _, g in per_rank), min_micro_batches), shares.shape[1])
    out = []
    for share, lengths, groups in per_rank:
        groups = split_to(groups, count, lambda g, lengths=lengths: micro_batch_cost([lengths[j] for j in g], packed,
                                                                                      multiple))  # fmt: skip
        out.append([[int(share[j]) for j in g] for g in groups])
    return out


class TokenBudgetBatchSampler:
    """This rank's micro-batches filled to a token budget, a whole global batch per optimizer step (the module's
    rule above); the order, the epoch's steps and the state are ``base``'s.

    Args:
        base: the run's sampler without patch balance (its order, global batch, accumulation and state).
        tokens: each sample's decoder positions (text and visual, at most the sequence length; 0: skipped when read).
        budget: ``model.data.max_tokens_per_micro_batch``.
        packed: ``model.data.packing`` (what a micro-batch costs: ``micro_batch_cost``).
        multiple: ``model.data.pad_to_multiple_of``.
        patches: a native tower's patches per sample (they join the data-parallel balance), or None.
        min_micro_batches: the fewest micro-batches a step may have (a 1F1B pipeline: one per stage).
    """

    def __init__(
        self,
        base: ResumableBatchSampler,
        tokens: Sequence[int],
        budget: int,
        packed: bool,
        multiple: int = 1,
        patches: Sequence[int] | None = None,
        min_micro_batches: int = 1,
    ) -> None:
        if base.patches is not None:
            raise ValueError("the token budget deals the ranks itself: give the base sampler no patches")
        self.base = base
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.budget = budget
        self.packed = packed
        self.multiple = multiple
        self.patches = None if patches is None else np.asarray(patches, dtype=np.int64)
        self.min_micro_batches = min_micro_batches
        self._plan: tuple[int, list[list[list[int]]]] | None = None  # (epoch, this rank's micro-batches per step)
        self._delivered = 0  # micro-batches of the current step handed to the training loop
        self.closes_step = False

    # -- the base sampler's quantities ------------------------------------------------------------------------------
    @property
    def step_samples(self) -> int:
        """Samples per optimizer step, all ranks together (``model.global_batch_size``)."""
        return self.base.global_batch * self.base.accumulation

    @property
    def sizes(self) -> list[int]:
        return self.base.sizes

    @property
    def global_batch(self) -> int:
        return self.base.global_batch

    @property
    def accumulation(self) -> int:
        return self.base.accumulation

    @property
    def num_steps(self) -> int:
        """As the base sampler's: global micro-batches of fixed size per epoch (``// accumulation``: steps)."""
        return self.base.num_steps

    @property
    def epoch(self) -> int:
        return self.base.epoch

    @property
    def consumed(self) -> int:
        return self.base.consumed

    def order(self, epoch: int) -> np.ndarray:
        return self.base.order(epoch)

    # -- the plan ----------------------------------------------------------------------------------------------------
    def step_plan(self, order: np.ndarray, step: int) -> list[list[list[int]]]:
        """Every rank's micro-batches of optimizer step ``step`` of an epoch's ``order``."""
        chunk = order[step * self.step_samples : (step + 1) * self.step_samples]
        return plan_step(
            chunk, self.tokens, self.base.dp_world, self.budget, self.packed, self.multiple, self.patches,
            self.min_micro_batches,
        )  # fmt: skip

    def _epoch_plan(self, epoch: int) -> list[list[list[int]]]:
        if self._plan is None or self._plan[0] != epoch:
            steps = self.base.num_steps // self.base.accumulation
            order, rank = self.base.order(epoch), self.base.dp_rank
            self._plan = (epoch, [self.step_plan(order, s)[rank] for s in range(steps)])
        return self._plan[1]

    def _rest(self) -> tuple[int, list[list[list[int]]]]:
        epoch, consumed = self.base.epoch, self.base.consumed
        if consumed >= self.base.num_steps * self.base.global_batch:
            epoch, consumed = epoch + 1, 0
        return epoch, self._epoch_plan(epoch)[consumed // self.step_samples :]

    def __len__(self) -> int:
        """Micro-batches the next ``__iter__`` yields."""
        return sum(len(step) for step in self._rest()[1])

    def steps_left(self) -> int:
        """Optimizer steps the next ``__iter__`` yields."""
        return len(self._rest()[1])

    def __iter__(self) -> Iterator[list[int]]:
        if self.base.consumed >= self.base.num_steps * self.base.global_batch:
            self.base.epoch, self.base.consumed = self.base.epoch + 1, 0
        self._delivered = 0
        for step in self._rest()[1]:
            yield from step

    def advance(self, micro_batches: int = 1) -> None:
        """Record that ``micro_batches`` micro-batches reached the training loop; a step's last one moves the state
        on by the step's samples (``closes_step``)."""
        for _ in range(micro_batches):
            self._delivered += 1
            plan = self._epoch_plan(self.base.epoch)
            step = self.base.consumed // self.step_samples
            self.closes_step = self._delivered == len(plan[step])
            if self.closes_step:
                self.base.consumed += self.step_samples
                self._delivered = 0

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict(state)
        self._delivered = 0
