"""A forward over a shard of every row's tokens (context parallelism), as the model sees it.

The parallel layer (``neva.parallel.context_parallel``) splits a micro-batch's rows over the ranks of a group and
hands each rank's forward a ``ContextShard``: which global columns its local columns are, the whole rows' segment
ids, which media features land on its positions, and ``gather``, the one collective the model calls where it needs
more than its own tokens. The model holds no process group and never asks which rank it is on beyond what the
shard tells it; it uses the shard at two places:

- attention (``neva.models.attention.plan_attention``): every layer gathers its keys and values into row order and
  the local queries attend them per segment, lower-right aligned: a query chunk against the whole row's keys up to
  its end, with the segment boundaries and sliding window of the one-process forward;
- media (``NevaModel.embed``): each rank encodes its share of the tower inputs, the projected features are gathered,
  and each rank writes the features whose positions it holds.

Every tensor field is on the host until ``to``; ``gather`` is differentiable (its backward sums each rank's slice of
the gradient over the ranks, a reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from neva.models.media import MODALITIES

# gather(t, dim, sizes): every rank's ``t`` concatenated along ``dim`` in rank order; ``sizes[r]`` is rank r's extent
# along ``dim`` (ranks may differ, e.g. a share of the images).
Gather = Callable[[torch.Tensor, int, list[int]], torch.Tensor]


@dataclass
class ContextShard:
    """This rank's share of the rows of one forward.

    Attributes:
        rank / size: this rank's place in the group the rows are split over, and its size.
        columns: ``[S_local]`` the global column of each local column (the same for every row).
        order: ``[size · S_local]`` index into the rank-major concatenation of every rank's columns giving row order.
        segment_ids: ``[B, S]`` the whole rows' sample ids (0 = padding; unpacked rows: one id for the whole row, a
            causal sequence whose padding follows every real token).
        features: per modality, ``[M_local]`` rows of the modality's features (in position order) whose positions
            this rank holds; its ``MediaInputs.positions`` are already local columns.
        gather: the group's differentiable all-gather (``Gather``).
        rotation: where the remainder of an uneven share of tower inputs starts (the splitter advances it per
            micro-batch, so no rank takes every remainder).
    """

    rank: int
    size: int
    columns: torch.Tensor
    order: torch.Tensor
    segment_ids: torch.Tensor
    gather: Gather
    features: dict[str, torch.Tensor] = field(default_factory=dict)
    rotation: int = 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ContextShard:
        """The index tensors on ``device`` (``columns`` and ``segment_ids`` stay on the host: attention plans read
        them there, without a sync)."""
        return replace(
            self,
            order=self.order.to(device, non_blocking=non_blocking),
            features={m: f.to(device, non_blocking=non_blocking) for m, f in self.features.items()},
        )

    def gather_sequence(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``t``'s local columns along ``dim`` gathered from every rank into row order (``[.., S, ..]``)."""
        local = t.shape[dim]
        return self.gather(t, dim, [local] * self.size).index_select(dim, self.order)

    def share_sizes(self, n: int, turn: int = 0) -> list[int]:
        """How many of ``n`` items each rank encodes: ``n // size``, one more for ``n % size`` ranks counted from
        ``(rotation + turn) % size`` (so that the remainders of successive calls fall on different ranks)."""
        base, extra = divmod(n, self.size)
        first = (self.rotation + turn) % self.size
        return [base + ((r - first) % self.size < extra) for r in range(self.size)]

    def encode_shared(
        self, encode: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor, modality: str
    ) -> torch.Tensor:
        """``encode(inputs)`` (per input, along dim 0), each rank encoding a contiguous share (``share_sizes``; each
        modality takes its turn) and the results gathered in input order: no rank runs every input."""
        sizes = self.share_sizes(inputs.shape[0], MODALITIES.index(modality))
        start = sum(sizes[: self.rank])
        return self.gather(encode(inputs[start : start + sizes[self.rank]]), 0, sizes)

    def local_features(self, modality: str, feats: torch.Tensor) -> torch.Tensor:
        """The rows of ``feats`` (``[M, D]``, every position of ``modality``) whose positions this rank holds."""
        rows = self.features.get(modality)
        if rows is None:
            return feats[:0]
        return feats.index_select(0, rows.to(feats.device))
