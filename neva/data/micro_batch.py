"""One micro-batch as the model and the objectives read it, and every reshaping of it: pad → join → split.

The collator (``neva.data.collate``) builds a ``MicroBatch``; nothing else builds one from scratch but the stages'
collators that start from it, the rehearsal's fake batches and tests. What was a dict of string keys is named fields:

- the model's per-token inputs ``[..., B, S]`` (``input_ids``, ``labels``, ``position_ids`` ``[P, B, S]``,
  ``segment_ids``; the engine's ``dropout_keys`` and an MoE objective's ``token_mask`` added before the model runs),
- its ``media`` (``neva.models.media.Media``),
- the learned-positions head's ``output_positions`` / ``targets`` (found on the host, by the collator),
- under context parallelism this rank's ``context`` and ``next_labels`` (``split_columns``),
- ``shared_prefix``: each row's first segment is a prompt that every later segment of the row attends too (the
  online RL stage's update rows, ``neva.data.grpo_rows``; an attention layout, as ``segment_ids`` are),
- what the loader did to its samples (``counts``: ``SampleCounts``, read by the skip accounting and the logs),
- one optional ``stage`` structure for what only one training stage's batches carry (``PreferencePairs``,
  ``RolloutRows``, ``PromptRows``), rather than a top-level optional field per stage.

The reshapings every layout needs are methods here, so one module knows which tensors go with the tokens:
``padded`` (pipeline stages and sequence parallelism agree one shape per step), ``joined`` (packed rows laid end to
end, padding dropped) and ``split_columns`` (context parallelism's share of the columns). A stage structure's own
per-token tensors (``TOKEN_FILL``) go with the tokens too.

Registered as a pytree node (as ``Media`` is) and with ``to`` / ``pin_memory``: the DataLoader's pinning and
Lightning's ``transfer_batch_to_device`` (``.to`` of a "transferable" object) move it whole; frozen, so a reshaping
returns a new one (``dataclasses.replace``) and never changes a batch another step still reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree

from neva.constants import IGNORE_INDEX
from neva.models.context_shard import ContextShard
from neva.models.media import Media

# The per-token tensors ``[..., B, S]`` of a micro-batch and what their padding holds: it learns nothing and precedes
# no real token (position_ids carry a leading axis of position axes).
TOKEN_FILL: dict[str, Any] = {
    "input_ids": 0, "labels": IGNORE_INDEX, "position_ids": 0, "segment_ids": 0, "dropout_keys": 0, "token_mask": False,
}  # fmt: skip


def _move(value: Any, device: torch.device | str, non_blocking: bool) -> Any:
    if isinstance(value, (torch.Tensor, Media, ContextShard)):
        return value.to(device, non_blocking=non_blocking)
    return value


def _map_fields(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` (a dataclass) with ``fn`` of every field that is not None (tensors, ``Media``, ``ContextShard``)."""
    changes = {f.name: fn(v) for f in fields(obj) if (v := getattr(obj, f.name)) is not None}
    return replace(obj, **changes)


@dataclass(frozen=True)
class SampleCounts:
    """What the loader did to a micro-batch's samples (not model input; ``neva.data.skips``, the step's logs).

    Attributes:
        num_samples: samples in the batch (skipped ones excluded; a preference batch: its pairs).
        skipped: skip reasons counted in this batch.
        truncated: samples cut to the maximum length (kept).
        dropped_leading_reply: samples whose leading assistant turn was dropped (kept, LLaVA's rule).
        visual_budget: samples the visual budget changed, by action (``neva.data.visual_budget``).
        ids: sample ids, in the order they appear in the rows.
    """

    num_samples: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    dropped_leading_reply: int = 0
    visual_budget: dict[str, int] = field(default_factory=dict)
    ids: list = field(default_factory=list)


@dataclass(frozen=True)
class PreferencePairs:
    """The preference stage's concatenated pair batch (``neva.data.preference.PairCollator``): rows ``0..P-1`` the
    chosen sequences, ``P..2P-1`` their rejected ones.

    Attributes:
        pairs: P.
        ref_logps: ``[2P]`` the reference's sequence log-probs (precomputed, or the objective's ``prepare``); None:
            not yet known.
        output_sequences: packed rows: ``[T]`` the sequence of each learned position (None: padded, the row is it).
    """

    TOKEN_FILL: ClassVar[dict[str, Any]] = {}

    pairs: int
    ref_logps: torch.Tensor | None = None
    output_sequences: torch.Tensor | None = None


@dataclass(frozen=True)
class RolloutRows:
    """The online RL stage's update rows (``neva.training.grpo_step``): each row a prompt and one completion, or
    (``MicroBatch.shared_prefix``, ``neva.data.grpo_rows``) a prompt and each of its group's completions.

    Attributes:
        advantages: ``[N]`` each completion's advantage (a row's, one completion a row).
        row_tokens: ``[N]`` each completion's learned tokens, counted on the whole rows (the objective's ``prepare``;
            shared-prompt rows: their collator).
        old_token_logps: ``[B, S]`` the policy's per-token log-probs before the first update of the rollouts.
        ref_token_logps: ``[B, S]`` the reference's.
        completion_at: shared-prompt rows: ``[B, S]`` the completion each learned prediction belongs to (-1
            elsewhere), aligned as the log-probs are; None: a row is its completion.
    """

    # Per-token tensors that go with the tokens when the batch is padded, joined or split (``TOKEN_FILL``).
    TOKEN_FILL: ClassVar[dict[str, Any]] = {"old_token_logps": 0.0, "ref_token_logps": 0.0, "completion_at": -1}

    advantages: torch.Tensor
    row_tokens: torch.Tensor | None = None
    old_token_logps: torch.Tensor | None = None
    ref_token_logps: torch.Tensor | None = None
    completion_at: torch.Tensor | None = None


@dataclass(frozen=True)
class PromptRows:
    """The online RL stage's prompt batch (``neva.data.grpo_prompts.PromptCollator``): the samples the rollouts
    complete and their records (the update's rows are built later, prompt + completion)."""

    TOKEN_FILL: ClassVar[dict[str, Any]] = {}

    prompts: list
    records: list


StageRows = PreferencePairs | RolloutRows | PromptRows


@dataclass(frozen=True)
class MicroBatch:
    """One collated micro-batch (the module docstring; shapes in ``neva.data.collate``'s batch contract)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    media: Media | None = None
    output_positions: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    dropout_keys: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    context: ContextShard | None = None
    next_labels: torch.Tensor | None = None
    shared_prefix: bool = False
    counts: SampleCounts = field(default_factory=SampleCounts)
    stage: StageRows | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """Rows × length."""
        return tuple(self.input_ids.shape)

    def with_(self, **changes: Any) -> MicroBatch:
        """A copy with ``changes`` (field names)."""
        return replace(self, **changes)

    def with_stage(self, **changes: Any) -> MicroBatch:
        """A copy whose ``stage`` structure has ``changes``."""
        return replace(self, stage=replace(self.stage, **changes))

    # -- device ----------------------------------------------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """Every tensor on ``device`` (``Media.to`` keeps a patch grid on the host); what Lightning's
        ``transfer_batch_to_device`` calls."""
        moved = _map_fields(self, lambda v: _move(v, device, non_blocking))
        stage = None if self.stage is None else _map_fields(self.stage, lambda v: _move(v, device, non_blocking))
        return replace(moved, stage=stage)

    def pin_memory(self) -> MicroBatch:
        """Pinned host copies (the DataLoader calls this on CUDA runs)."""

        def pin(v: Any) -> Any:
            return v.pin_memory() if isinstance(v, (torch.Tensor, Media)) else v

        stage = None if self.stage is None else _map_fields(self.stage, pin)
        return replace(_map_fields(self, pin), stage=stage)

    # -- the per-token tensors ---------------------------------------------------------------------------------------
    def map_tokens(self, fn: Callable[[torch.Tensor, Any], torch.Tensor], skip: tuple[str, ...] = ()) -> MicroBatch:
        """Every per-token tensor ``[..., B, S]`` present (``TOKEN_FILL``, the stage's own too), but ``skip``, as
        ``fn(tensor, padding fill)``."""
        top = {
            k: fn(v, fill) for k, fill in TOKEN_FILL.items() if k not in skip and (v := getattr(self, k)) is not None
        }
        stage = self.stage
        if stage is not None and stage.TOKEN_FILL:
            changes = {k: fn(v, fill) for k, fill in stage.TOKEN_FILL.items() if (v := getattr(stage, k)) is not None}
            stage = replace(stage, **changes)
        return replace(self, stage=stage, **top)

    # -- pad -------------------------------------------------------------------------------------------------------
    def padded(self, rows: int, length: int) -> MicroBatch:
        """Padded to ``rows`` × ``length`` (pipeline stages and sequence parallelism agree one shape per step);
        padding learns nothing and precedes no real token."""
        b, s = self.shape
        out = self
        if (b, s) != (rows, length):

            def pad(t: torch.Tensor, fill: Any) -> torch.Tensor:
                padded = torch.full((*t.shape[:-2], rows, length), fill, dtype=t.dtype)  # [P, B, S] positions too
                padded[..., :b, :s] = t
                return padded

            out = self.map_tokens(pad)
        return out if self.media is None else replace(out, media=self.media.padded_rows(rows))

    # -- join ------------------------------------------------------------------------------------------------------
    def joined(self) -> MicroBatch:
        """A packed batch as one row holding only its real tokens: rows laid end to end, padding dropped.

        Where attention runs per segment (``neva.models.attention.attends_per_segment``), row boundaries mean nothing
        to the model: every other layer is position-wise. Dropping the padding that first-fit leaves at the end of
        each row skips its linear, attention and elementwise work (on the CPU benchmark ~13% of the positions at rows
        of 1024). The loss and gradients are those of the rows (up to float rounding of the differently shaped
        matmuls).

        Every per-token tensor keeps its real tokens in row order; segments are renumbered so that samples of
        neighbouring rows stay apart; (row, column) positions are remapped and the media's items per row become the
        batch total (``Media.joined``). Host tensors in, host tensors out (the collator's side of the step).
        """
        seg = self.segment_ids
        b, s = seg.shape
        real = (seg > 0).flatten()
        keep = real.nonzero().squeeze(1)
        n = keep.numel()
        new_col = torch.full((b * s,), -1, dtype=torch.long)
        new_col[keep] = torch.arange(n)
        out = self.map_tokens(lambda t, _: t.flatten(-2)[..., keep].unsqueeze(-2))
        rows, kept_seg = keep // s, seg.flatten()[keep]
        starts = torch.ones(n, dtype=torch.long)
        starts[1:] = ((kept_seg[1:] != kept_seg[:-1]) | (rows[1:] != rows[:-1])).long()

        def remap(pos: torch.Tensor) -> torch.Tensor:
            cols = new_col[pos[:, 0] * s + pos[:, 1]]
            return torch.stack([torch.zeros_like(cols), cols], dim=1)

        return replace(
            out,
            segment_ids=torch.cumsum(starts, 0)[None],
            output_positions=None if self.output_positions is None else remap(self.output_positions),
            media=None if self.media is None else self.media.joined(remap),
        )

    # -- split -----------------------------------------------------------------------------------------------------
    def split_columns(
        self,
        cp: int,
        rank: int,
        gather: Callable[[torch.Tensor, int, list[int]], torch.Tensor],
        packed: bool,
        rotation: int = 0,
        multiple: int = 1,
    ) -> MicroBatch:
        """This rank's share of the (host) micro-batch's columns under context parallelism (chunks ``rank`` and
        ``2·cp − 1 − rank`` of rows padded to a multiple of ``2·cp·multiple``), with the ``context`` the model takes.

        ``labels`` become ``next_labels``, what each of this rank's positions predicts (a shifted loss over the split
        columns would pair tokens across chunk boundaries); the learned-positions head reads ``output_positions`` /
        ``targets``. ``packed``: segment ids bound attention (else one causal run per row, as the unpacked forward has
        it). ``gather``: the all-gather over the cp group (``neva.parallel.context_parallel``: this module knows no
        process group). ``rotation``: see ``ContextShard``; ``multiple``: sequence parallelism's tp.
        """
        b, s = self.shape
        unit = 2 * cp * multiple
        length = -(-s // unit) * unit
        columns = chunk_columns(length, cp, rank)
        next_labels = None
        if self.labels is not None:
            following = torch.full((b, length), IGNORE_INDEX, dtype=self.labels.dtype)
            following[:, : s - 1] = self.labels[:, 1:]
            next_labels = following[:, columns]

        def share(t: torch.Tensor, fill: Any) -> torch.Tensor:  # every per-token tensor goes with its tokens
            if length > s:
                t = torch.cat([t, t.new_full((*t.shape[:-1], length - s), fill)], dim=-1)
            return t[..., columns]

        out = replace(self.map_tokens(share, skip=("labels",)), labels=None, next_labels=next_labels)
        segments = self.segment_ids if packed else None
        if segments is None:
            segments = torch.ones(b, length, dtype=torch.long)
        elif length > s:
            segments = torch.cat([segments, segments.new_zeros(b, length - s)], dim=1)
        local = torch.full((length,), -1, dtype=torch.long)
        local[columns] = torch.arange(columns.numel())
        if self.output_positions is not None:
            keep, positions = _localize(self.output_positions, local)
            out = replace(out, output_positions=positions, targets=self.targets[keep])
        features = {}
        if self.media is not None:
            media = {}
            for modality, inputs in self.media.items():
                if inputs is not None and inputs.positions is not None:
                    keep, positions = _localize(inputs.positions, local)
                    features[modality] = keep.nonzero().squeeze(1)
                    inputs = replace(inputs, positions=positions)
                media[modality] = inputs
            out = replace(out, media=replace(self.media, **media))
        every = torch.cat([chunk_columns(length, cp, r) for r in range(cp)])
        context = ContextShard(
            rank=rank,
            size=cp,
            columns=columns,
            order=torch.argsort(every),
            segment_ids=segments,
            gather=gather,
            features=features,
            rotation=rotation,
            every=every,
        )
        return replace(out, context=context)


def step_shape(micro_batches: list[MicroBatch], multiple: int = 1) -> tuple[int, int]:
    """Rows × length that every micro-batch of a step is padded to: the longest, length rounded up to ``multiple``."""
    rows = max(mb.shape[0] for mb in micro_batches)
    length = max(mb.shape[1] for mb in micro_batches)
    return rows, -(-length // multiple) * multiple


def pad_micro_batches(
    micro_batches: list[MicroBatch], multiple: int = 1, shape: tuple[int, int] | None = None
) -> list[MicroBatch]:
    """Pad every micro-batch to ``shape`` (default ``step_shape``): ``MicroBatch.padded``."""
    rows, length = shape or step_shape(micro_batches, multiple)
    return [mb.padded(rows, length) for mb in micro_batches]


def chunk_columns(length: int, cp: int, rank: int) -> torch.Tensor:
    """The global columns rank ``rank`` holds of a row of ``length`` (a multiple of ``2 · cp``): chunks ``rank``
    and ``2 · cp − 1 − rank``."""
    chunk = length // (2 * cp)
    front = torch.arange(rank * chunk, (rank + 1) * chunk)
    back = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([front, back])


def _localize(positions: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep [M] bool, positions [M_local, 2])``: the ``(row, column)`` positions on this rank's columns, their
    columns made local."""
    cols = local[positions[:, 1]]
    keep = cols >= 0
    return keep, torch.stack([positions[keep, 0], cols[keep]], dim=1)


# Registered nodes: pytree maps (``tree_map``, pipeline stages' flattening) see the tensors inside, as ``Media``'s.
for _cls in (MicroBatch, PreferencePairs, RolloutRows, PromptRows):
    pytree.register_dataclass(_cls)
