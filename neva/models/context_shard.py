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
  and each rank writes the features whose positions it holds. Fixed-size tower inputs (images, AnyRes tiles, video
  frames) are shared by count (``encode_shared``); a native-resolution tower's items (images, videos: one grid row
  each, of very different patch counts) by patch count (``encode_native_shared``), DeepStack features with them.

Every tensor field is on the host until ``to``; ``gather`` is differentiable (its backward sums each rank's slice of
the gradient over the ranks, a reduce-scatter).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from neva.models.features import VisualFeatures
from neva.models.media import MODALITIES
from neva.models.native_vision import grid_rows

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
        every: ``[size · S_local]`` every rank's global columns, rank-major (``order`` is its argsort), on the host:
            linear-attention layers read it as integers (``neva.models.recurrent_shard``), which the fake-tensor
            rehearsal passes through only for a host tensor never operated on. None where no layer needs it.
    """

    rank: int
    size: int
    columns: torch.Tensor
    order: torch.Tensor
    segment_ids: torch.Tensor
    gather: Gather
    features: dict[str, torch.Tensor] = field(default_factory=dict)
    rotation: int = 0
    every: torch.Tensor | None = None

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

    def encode_native_shared(
        self,
        encode: Callable[[torch.Tensor, torch.Tensor], VisualFeatures],
        pixels: torch.Tensor,
        grid: torch.Tensor,
        merge: int,
        modality: str,
    ) -> VisualFeatures:
        """``encode(pixels, grid)`` of a native-resolution tower and merger (``[L, C·T·P·P]`` patches of the items of
        ``grid`` ``[N, 3]``, host ints) → ``VisualFeatures`` of ``L / merge²`` rows, each rank encoding a contiguous run
        of whole items (``native_shares``: balanced by patches) and every output (``main`` and each DeepStack one)
        gathered in item order. Exact: the tower and merger never mix two items (attention within frames or windows,
        positions per item)."""
        patches = [t * h * w for t, h, w in grid_rows(grid)]
        counts = native_shares(patches, self.size, (self.rotation + MODALITIES.index(modality)) % 2 == 1)
        first = sum(counts[: self.rank])
        bounds = list(itertools.accumulate(counts, initial=0))
        per_rank = [sum(patches[a:b]) for a, b in itertools.pairwise(bounds)]
        start = sum(patches[:first])
        mine = encode(pixels[start : start + per_rank[self.rank]], grid[first : first + counts[self.rank]])
        sizes = [n // merge**2 for n in per_rank]
        return VisualFeatures(self.gather(mine.main, 0, sizes), [self.gather(d, 0, sizes) for d in mine.deepstack])

    def local_features(self, modality: str, feats: torch.Tensor) -> torch.Tensor:
        """The rows of ``feats`` (``[M, D]``, every position of ``modality``) whose positions this rank holds."""
        rows = self.features.get(modality)
        if rows is None:
            return feats[:0]
        return feats.index_select(0, rows.to(feats.device))


def native_shares(patches: list[int], size: int, from_back: bool = False) -> list[int]:
    """How many of the items (in order; ``patches``: each one's tower patches) each of ``size`` ranks encodes:
    contiguous runs, item i to the rank whose ``1 / size`` of the total patches holds the item's middle (so each rank's
    patches are within one item of an equal share). By patches, not by count: native items differ by up to ~100×
    in patches (a 2048² image against a 224² one) and the tower's work follows them. ``from_back``: the same rule
    from the last item (the ties of equal items then fall on the other ranks: the splitter alternates it per
    micro-batch, as ``share_sizes`` rotates its remainders)."""
    if from_back:
        return native_shares(patches[::-1], size)[::-1]
    total = sum(patches)
    counts = [0] * size
    prefix = 0
    for n in patches:
        rank = min(size - 1, (2 * prefix + n) * size // (2 * total)) if total else 0
        counts[rank] += 1
        prefix += n
    return counts
