"""Attention core without dense masks: which kernel attends, decided once per forward and shared by every layer.

Packed rows hold several samples; each must attend causally within itself only. A dense ``[B, 1, S, S]`` mask would
rule out the flash kernels, make SDPA compute every block (other samples' and the upper triangle included) and, with
GQA, fall to the math kernel that materialises ``[B, H, S, S]``. Instead:

- no segments, no cache: SDPA ``is_causal`` (right padding needs nothing more: a real token never sits after padding,
  so its causal window holds real tokens only — padded positions carry no loss);
- no segments, with a cache: no mask for one new query, else a lower-right causal ``[Sq, Sk]`` mask (``is_causal``
  aligns top-left, wrong once queries start after cached keys);
- segments on CUDA without a cache (training): FlexAttention with a document-causal ``BlockMask`` (blocks outside
  a sample are skipped, not computed and masked);
- segments otherwise (CPU, where FlexAttention has no fused backward; cached prefill): causal SDPA per segment;
- a single new query with segments (decoding a left-padded batch): a key-padding mask ``[B, 1, 1, K]``, linear in K.

A sliding window (Mistral v0.1: a query sees itself and the ``window - 1`` tokens before it) narrows every path
exactly: where some query could see more than ``window`` keys, the causal SDPA calls take a lower-right banded
``[Sq, Sk]`` mask (per segment, broadcast over batch and heads), the key-padding mask drops keys further back, and
the BlockMask's ``mask_mod`` adds the distance. Generation keeps the whole cache and masks what lies outside.

Context parallelism (``neva.models.context_shard``): a forward over a shard of every row's columns (two chunks of
it, load-balanced for causal attention) gathers every layer's keys and values into row order (``gather``) and its
queries attend per segment: each local query chunk against the segment's keys up to the chunk's end, lower-right
aligned, on the per-segment path (no dense mask; the window, if any, as above).

Segments are the maximal runs of equal ``segment_ids`` in a row (the collator writes each sample contiguously;
padding is a run of 0s that attends causally within itself, exactly as the dense mask had it). Every path computes
the same function as a dense segment-causal mask + SDPA (the reference in tests/models/test_attention.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neva.models.context_shard import ContextShard

_COMPILED_FLEX = None


def _flex_attention():
    """``flex_attention`` compiled once (uncompiled it runs a reference path that materialises the scores)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        # Default (automatic) dynamic shapes: packed rows change length from batch to batch (multiples of 64), and a
        # static compile per length would soon hit the recompile limit and fall back to the score-materialising path.
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


def document_causal_block_mask(
    segment_ids: torch.Tensor, q_len: int, offset: int = 0, compile_mask: bool = True, window: int | None = None
):
    """FlexAttention ``BlockMask``: query ``offset + q`` sees key ``k`` iff ``k <= offset + q`` and both lie in the
    same segment (and, with ``window``, ``offset + q - k < window``). Built on ``segment_ids``' device without a host
    sync."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, keys = segment_ids.shape

    def mask_mod(batch, head, q, kv):
        q_abs = q + offset
        return (segment_ids[batch, q_abs] == segment_ids[batch, kv]) & (kv <= q_abs)

    if window is not None:
        document_causal = mask_mod

        def mask_mod(batch, head, q, kv):
            return document_causal(batch, head, q, kv) & (q + offset - kv < window)

    # _compile: the eager builder evaluates mask_mod on the whole [B, S, S] grid at once.
    return create_block_mask(mask_mod, b, None, q_len, keys, device=segment_ids.device, _compile=compile_mask)


def segment_runs(segment_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """``[(start, end), ...]`` per row: the maximal runs of equal segment id (host-side; a CPU tensor costs no sync).

    Read as Python integers, without tensor ops: the full-size rehearsal runs the step under a fake tensor mode,
    which passes a host tensor's ``tolist`` through but would fake (and lose the values of) an op on it."""
    out = []
    for row in segment_ids.tolist():
        starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
        out.append(list(zip(starts, starts[1:] + [len(row)])))
    return out


@dataclass
class AttentionPlan:
    """How every layer of one forward attends. Build with ``plan_attention``; call ``attend(q, k, v)``.

    q ``[B, H, Sq, D]``, k/v ``[B, Hkv, Sk, D]`` (Hkv may divide H: GQA, never expanded to H here).
    """

    kind: str  # causal | causal_lower_right | flex | segments | key_padding
    block_mask: object | None = None  # flex
    spans: list[list[tuple[int, int, int, int]]] | None = None  # segments: per row, (q0, q1, k0, k1)
    mask: torch.Tensor | None = None  # key_padding: [B, 1, 1, K] bool (the window already applied)
    window: int | None = None  # sliding window in tokens (None: no limit)
    # context parallelism: keys/values ``[B, Hkv, S_local, D]`` → the whole rows' ``[B, Hkv, S, D]`` (a collective)
    gather: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    # hybrid decoders: packed rows' samples as rows of their own for the linear-attention layers
    # (``neva.models.gated_deltanet.PackedRows``; None: each row is one sequence)
    recurrent: object | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if self.gather is not None:  # one collective for keys and values
            k, v = self.gather(torch.stack([k, v]), 3).unbind(0)
        if self.kind in ("causal", "causal_lower_right"):
            return _causal(q, k, v, gqa, self.window)
        if self.kind == "key_padding":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        if self.kind == "flex":
            return _flex(q, k, v, self.block_mask, gqa)
        return _per_segment(q, k, v, self.spans, gqa, self.window)


def _causal(q, k, v, gqa: bool, window: int | None) -> torch.Tensor:
    """Causal attention of the last ``Sq`` of ``Sk`` positions (lower-right aligned; top-left when Sq == Sk), within
    ``window``."""
    q_len, k_len = q.shape[2], k.shape[2]
    if window is None or k_len <= window:  # no query can see more than the window
        if q_len == k_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if q_len == 1:  # one query after the cache sees every key
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    # A [Sq, Sk] mask broadcast over batch and heads (cached chunked prefill, or a window; never [B, H, S, S]).
    ones = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
    mask = ones.tril(diagonal=k_len - q_len)
    if window is not None:
        mask &= ~ones.tril(diagonal=k_len - q_len - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _flex(q, k, v, block_mask, gqa: bool) -> torch.Tensor:
    if torch.is_autocast_enabled(q.device.type):
        # SDPA casts under autocast; FlexAttention does not, and wants one dtype for q, k and v.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return _flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa)


@torch.compiler.disable  # the span list changes every batch: compiling it would recompile per batch
def _per_segment(q, k, v, spans, gqa: bool, window: int | None = None) -> torch.Tensor:
    if q.shape[2] == k.shape[2]:
        # No cache: each row's spans tile it, for queries and keys alike. ``split`` (not slicing) keeps backward to
        # one concatenation per row instead of a zero-filled full-size gradient per segment.
        # Outputs are concatenated token-major ([B, S, H, D] memory, returned as its [B, H, S, D] view): the caller's
        # transpose back to tokens and merge of the heads is then a view, not another copy.
        rows = []
        for q_r, k_r, v_r, row_spans in zip(q.unbind(0), k.unbind(0), v.unbind(0), spans):
            sizes = [qe - qs for qs, qe, _, _ in row_spans]
            outs = [
                _causal(qi[None], ki[None], vi[None], gqa, window)
                for qi, ki, vi in zip(q_r.split(sizes, 1), k_r.split(sizes, 1), v_r.split(sizes, 1))
            ]
            rows.append(torch.cat([o.transpose(1, 2) for o in outs], dim=1))
        return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)).transpose(1, 2)
    rows = []
    for r, row_spans in enumerate(spans):
        outs = []
        for qs, qe, ks, ke in row_spans:
            qi, ki, vi = q[r : r + 1, :, qs:qe], k[r : r + 1, :, ks:ke], v[r : r + 1, :, ks:ke]
            # Queries after cached keys of their segment align lower-right.
            outs.append(_causal(qi, ki, vi, gqa, window))
        rows.append(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def attends_per_segment(device: torch.device) -> bool:
    """Whether packed training rows attend by causal SDPA per segment on ``device`` (FlexAttention on CUDA)."""
    return device.type != "cuda"


def plan_attention(
    segment_ids: torch.Tensor | None,
    q_len: int,
    offset: int,
    device: torch.device,
    window: int | None = None,
    shard: ContextShard | None = None,
) -> AttentionPlan:
    """The attention of one forward over ``q_len`` new tokens after ``offset`` cached ones.

    Args:
        segment_ids: ``[B, offset + q_len]`` sample id per key position (0 = padding), or None (one causal sequence
            per row; right padding allowed).
        device: where the activations are; CUDA training takes FlexAttention.
        window: sliding window (a query sees itself and ``window - 1`` earlier keys), or None.
        shard: context parallelism: the ``q_len`` queries are this rank's columns of longer rows (``segment_ids`` is
            then ignored: the shard carries the whole rows').
    """
    if shard is not None:
        return _plan_shard(shard, window, device)
    if segment_ids is None:
        return AttentionPlan("causal" if offset == 0 else "causal_lower_right", window=window)
    if q_len == 1:
        seg = segment_ids
        mask = seg == seg[:, -1:]
        if window is not None and seg.shape[1] > window:
            mask[:, : seg.shape[1] - window] = False
        return AttentionPlan("key_padding", mask=mask[:, None, None, :], window=window)
    if not attends_per_segment(device) and offset == 0:
        return AttentionPlan(
            "flex", block_mask=document_causal_block_mask(segment_ids, q_len, window=window), window=window
        )
    spans = []
    for runs in segment_runs(segment_ids):
        # Keys of a run up to the last query in it; queries are the run's positions at or after ``offset``.
        spans.append([(max(s, offset) - offset, e - offset, s, e) for s, e in runs if e > offset])
    return AttentionPlan("segments", spans=spans, window=window)


def shard_mask_mod(columns: torch.Tensor, segment_ids: torch.Tensor, window: int | None = None):
    """FlexAttention ``mask_mod`` of a context-parallel shard: local query ``q`` (global column ``columns[q]``) sees
    gathered key ``kv`` iff both lie in the same segment, ``kv <= columns[q]`` (and, with ``window``, within it)."""

    def mask_mod(batch, head, q, kv):
        q_abs = columns[q]
        visible = (segment_ids[batch, q_abs] == segment_ids[batch, kv]) & (kv <= q_abs)
        return visible if window is None else visible & (q_abs - kv < window)

    return mask_mod


def _plan_shard(shard: ContextShard, window: int | None, device: torch.device) -> AttentionPlan:
    """Local queries against the gathered rows. CUDA: FlexAttention with a query-column map. Otherwise per segment:
    for each local chunk (a run of consecutive global columns) and each segment it meets, the chunk's queries in the
    segment attend the segment's keys up to the chunk's last one (lower-right aligned)."""
    if not attends_per_segment(device):
        from torch.nn.attention.flex_attention import create_block_mask

        seg = shard.segment_ids.to(device)
        mask_mod = shard_mask_mod(shard.columns.to(device), seg, window)
        b, keys = seg.shape
        # _compile: as document_causal_block_mask (the eager builder evaluates mask_mod on the whole grid at once)
        block_mask = create_block_mask(mask_mod, b, None, shard.columns.numel(), keys, device=device, _compile=True)
        return AttentionPlan("flex", block_mask=block_mask, window=window, gather=shard.gather_sequence)
    columns = shard.columns.tolist()
    chunks, start = [], 0  # (local start, global start, global end)
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i] != columns[i - 1] + 1:
            chunks.append((start, columns[start], columns[i - 1] + 1))
            start = i
    spans = []
    for runs in segment_runs(shard.segment_ids):
        row = []
        for local, g0, g1 in chunks:
            for s, e in runs:
                a, b = max(s, g0), min(e, g1)
                if a < b:
                    row.append((local + a - g0, local + b - g0, s, b))
        spans.append(row)
    return AttentionPlan("segments", spans=spans, window=window, gather=shard.gather_sequence)
