"""Samples → micro-batches (``neva.data.micro_batch.MicroBatch``): padded rows, or samples packed first-fit into
rows (padding-free packing).

Batch contract (both modes; the ``MicroBatch`` fields)::

    input_ids    LongTensor [B, S]   pad id where segment_ids == 0
    labels       LongTensor [B, S]   IGNORE_INDEX where not learned; the first token of every sample is ignored
    position_ids LongTensor [P, B, S] each sample's own positions at its place in its row; 0 on padding. A sample's
                                     ``position_ids`` [P_s, n] (M-RoPE: [3, n], ``neva.models.mrope``) if it
                                     brings them, else 0..n-1: restart at every sample. P = the most axes a sample
                                     brings (at least the collator's ``position_axes``): 1 for text and LLaVA's
                                     flattened image features; a one-axis sample broadcasts over the P axes (M-RoPE's
                                     text: the three axes are equal)
    segment_ids  LongTensor [B, S]   1..k for the k samples of a row, 0 on padding
    media        Media               what the model sees besides text (``neva.models.media``): per modality a
                                     ``MediaInputs`` (None: no item of it in the batch) —
        image: pixels [N, 3, H, W] uint8 (every image, or AnyRes tile, in row then position order), items_per_row
               [B] images per row, positions [M, 2] (row, column) of every image-token position in the order the
               features fill them (None when a sample did not say where its images are), AnyRes: index [M] (or
               [M, 4] taps with weight [M, 4] under anyres_max_N) the row of the batch's flattened tile features for
               each position, -1 = image_newline (``neva.models.anyres``); native resolution: pixels [L, C·T·P·P]
               every image's flattened patches and grid [N, 3] (t, h, w) per image (the samples' ``image_grid``)
        video: pixels [F, 3, H, W] every sampled frame (row then position order, each video's frames in time
               order), frames [V] per video, positions [M_v, 2] in the order the frames' pooled features fill them
               (``NevaConfig.video_tokens(F)`` per video); native resolution: pixels [L, C·T·P·P] every video's
               temporal patches and grid [V, 3] per video (the samples' ``video_grid``)
    output_positions LongTensor [T, 2]   (row, column) of every position whose logits predict a learned label
    targets      LongTensor [T]      the label each of those positions predicts
    counts       SampleCounts        what the loader did to the samples: num_samples (skipped ones excluded), skipped
                                     (reasons counted), truncated, dropped_leading_reply, visual_budget, ids

The media positions, ``output_positions`` and ``targets`` are found here, on the host (in the loader workers), so the
model splices image features and picks the LM-head positions with index ops: no host-device sync per micro-batch.

When every sample of a micro-batch was skipped the batch has one row of padding with ``segment_ids`` 1 and no
learned tokens (``counts.num_samples`` 0): every data-parallel rank still runs forward/backward, so collectives stay in step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from neva.constants import IGNORE_INDEX
from neva.data.anyres import sample_layout
from neva.data.dataset import is_skipped
from neva.data.micro_batch import MicroBatch, SampleCounts
from neva.models.anyres import Layout, concat_layouts
from neva.models.loss import learned_positions
from neva.models.media import Media, MediaInputs


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Pack items (by index, in order) into bins of ``capacity``: each goes into the first bin with room.

    Raises:
        ValueError: an item longer than ``capacity``.
    """
    bins: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sample of {n} tokens does not fit a row of {capacity}")
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


def _row_length(longest: int, multiple: int, max_length: int | None) -> int:
    length = round_up(max(longest, 1), multiple)
    # Rounding must not push a row past the model's maximum sequence length.
    return min(length, max_length) if max_length is not None else length


def _image_inputs(
    pixels: list[torch.Tensor],
    counts: torch.Tensor,
    positions: list | None,
    layouts: list[Layout],
    tile_tokens: int | None,
    grids: list[torch.Tensor],
) -> MediaInputs | None:
    if not pixels:
        return None
    image = MediaInputs(torch.cat(pixels), _cat_positions(positions), items_per_row=counts)
    if grids:  # native resolution: each image's patch grid, in the order of its patches
        return replace(image, grid=torch.cat(grids))
    if tile_tokens is None:
        return image
    lay = concat_layouts(layouts, tile_tokens)  # AnyRes: each image's index offset by the tiles before it
    return replace(image, index=lay.index, weight=lay.weight)


def _cat_positions(positions: list | None) -> torch.Tensor | None:
    if positions is None:
        return None
    return torch.cat(positions) if positions else torch.zeros(0, 2, dtype=torch.long)


def _position_axes(rows: list[list[dict[str, Any]]], least: int) -> int:
    return max([least] + [s["position_ids"].shape[0] for row in rows for s in row if "position_ids" in s])


def _assemble(
    rows: list[list[dict[str, Any]]], row_len: int, pad_id: int, skipped: Counter, position_axes: int = 1
) -> MicroBatch:
    bsz = max(len(rows), 1)
    input_ids = torch.full((bsz, row_len), pad_id, dtype=torch.long)
    labels = torch.full((bsz, row_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((_position_axes(rows, position_axes), bsz, row_len), dtype=torch.long)
    segment_ids = torch.zeros((bsz, row_len), dtype=torch.long)
    image_counts = torch.zeros(bsz, dtype=torch.long)
    pixels, ids, image_positions, layouts, tile_tokens, grids = [], [], [], [], None, []
    video_pixels, video_frames, video_positions, video_grids = [], [], [], []
    for r, row in enumerate(rows):
        pos = 0
        for seg, sample in enumerate(row, start=1):
            n = sample["input_ids"].numel()
            input_ids[r, pos : pos + n] = sample["input_ids"]
            labels[r, pos : pos + n] = sample["labels"]
            # The token before a sample belongs to another sample (or nothing): never a target across the boundary.
            labels[r, pos] = IGNORE_INDEX
            # The one place a sample's positions meet the batch's axes: [P_s, n] or [n] broadcasts over P.
            position_ids[:, r, pos : pos + n] = sample["position_ids"] if "position_ids" in sample else torch.arange(n)
            segment_ids[r, pos : pos + n] = seg
            pos += n
            image_counts[r] += sample.get("image_count", sample["pixel_values"].shape[0])
            if sample["pixel_values"].shape[0]:
                pixels.append(sample["pixel_values"])
                if "image_grid" in sample:
                    grids.append(sample["image_grid"])
            if "image_feature_index" in sample:  # AnyRes: offset by the tiles of the samples before
                layouts.append(sample_layout(sample))
                tile_tokens = sample["tile_tokens"]
            if image_positions is not None and "image_positions" in sample:
                cols = sample["image_positions"] + pos - n
                image_positions.append(torch.stack([torch.full_like(cols, r), cols], dim=1))
            else:
                image_positions = None
            if "video_positions" in sample:
                cols = sample["video_positions"] + pos - n
                video_positions.append(torch.stack([torch.full_like(cols, r), cols], dim=1))
                video_pixels.append(sample["video_pixel_values"])
                video_frames.append(sample["video_frames"])
                if "video_grid" in sample:  # native resolution: each video's temporal-patch grid
                    video_grids.append(sample["video_grid"])
            ids.append(sample["id"])
    if not rows:
        segment_ids[0] = 1  # an all-skipped micro-batch: one inert row (see module docstring)
        position_ids[:, 0] = torch.arange(row_len)
    num_samples = sum(len(row) for row in rows)
    output_positions, targets = learned_positions(labels)
    return MicroBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        segment_ids=segment_ids,
        media=Media(
            image=_image_inputs(pixels, image_counts, image_positions, layouts, tile_tokens, grids),
            video=MediaInputs(
                torch.cat(video_pixels),
                torch.cat(video_positions),
                frames=torch.cat(video_frames),
                grid=torch.cat(video_grids) if video_grids else None,
            )
            if video_pixels
            else None,
        ),
        output_positions=output_positions,
        targets=targets,
        counts=SampleCounts(
            num_samples=num_samples,
            skipped=dict(skipped),
            truncated=sum(bool(s.get("truncated")) for row in rows for s in row),
            dropped_leading_reply=sum(bool(s.get("dropped_leading_reply")) for row in rows for s in row),
            # samples the visual budget changed, by action (neva.data.visual_budget)
            visual_budget=dict(Counter(s["visual_budget"] for row in rows for s in row if s.get("visual_budget"))),
            ids=ids,
        ),
    )


def _split(batch: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Counter]:
    good = [s for s in batch if not is_skipped(s)]
    skipped = Counter(s["skipped"] for s in batch if is_skipped(s))
    return good, skipped


def collate_padded(
    batch: list[dict[str, Any]],
    pad_id: int,
    pad_to_multiple_of: int = 64,
    max_length: int | None = None,
    position_axes: int = 1,
) -> MicroBatch:
    """One sample per row, right-padded to the longest rounded up to ``pad_to_multiple_of`` (capped at ``max_length``).

    ``position_axes``: the fewest position axes of the batch (an M-RoPE model's 3, so that a text-only batch has the
    shape of every other: pipeline stages and compiled graphs see one shape).
    """
    good, skipped = _split(batch)
    longest = max((s["input_ids"].numel() for s in good), default=1)
    length = _row_length(longest, pad_to_multiple_of, max_length)
    return _assemble([[s] for s in good], length, pad_id, skipped, position_axes)


def collate_packed(
    batch: list[dict[str, Any]], pad_id: int, seq_length: int, pad_to_multiple_of: int = 64, position_axes: int = 1
) -> MicroBatch:
    """Samples packed first-fit (in order) into rows of at most ``seq_length`` tokens.

    Rows are as long as the fullest row rounded up to ``pad_to_multiple_of`` (capped at ``seq_length``).
    ``position_axes`` as in ``collate_padded``.
    """
    good, skipped = _split(batch)
    bins = first_fit([s["input_ids"].numel() for s in good], seq_length)
    rows = [[good[i] for i in b] for b in bins]
    longest = max((sum(s["input_ids"].numel() for s in row) for row in rows), default=1)
    return _assemble(rows, _row_length(longest, pad_to_multiple_of, seq_length), pad_id, skipped, position_axes)


class Collator:
    """Picklable collate function for DataLoader workers (padded or packed by ``packing``)."""

    def __init__(
        self,
        pad_id: int,
        seq_length: int,
        pad_to_multiple_of: int = 64,
        packing: bool = False,
        position_axes: int = 1,
    ) -> None:
        self.pad_id = pad_id
        self.seq_length = seq_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.packing = packing
        self.position_axes = position_axes  # an M-RoPE model's 3: every batch, text-only ones too, has 3 axes

    def __call__(self, batch: list[dict[str, Any]]) -> MicroBatch:
        if self.packing:
            return collate_packed(batch, self.pad_id, self.seq_length, self.pad_to_multiple_of, self.position_axes)
        return collate_padded(batch, self.pad_id, self.pad_to_multiple_of, self.seq_length, self.position_axes)
