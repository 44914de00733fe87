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

Bidirectional blocks (Gemma 3: an image's tokens attend to one another both ways, HF's ``token_type_ids`` blocks):
the ``[M, 2]`` (row, column) positions of those tokens, whose maximal runs are the blocks. A query inside a block sees its
segment's keys up to the block's end (causal before it, every key of the block); the window, if any, still bounds
how far back it sees. Per segment (CPU), a segment with blocks is attended in chunks: each text run causally against
the segment's keys up to the run's end (lower-right aligned), each block against the keys up to its end with no causal
mask (a band only where the window cuts); on CUDA the BlockMask's ``mask_mod`` adds "same block". One new query
(decoding) is text: blocks change nothing for it.

Shared prompts (the online RL stage's update, ``neva.data.grpo_rows``): a row holds one prompt, its first segment,
and after it several completions of that prompt, each a segment that attends the prompt and itself (causally), as if
each were a row of its own after the prompt. The prompt is then computed once for the whole group. Always per segment
(on CUDA too): each later segment's keys are the prompt's followed by its own, lower-right aligned, which is exactly
the causal window (and the sliding window) of the separate row, since its positions continue the prompt's.

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
    segment_ids: torch.Tensor,
    q_len: int,
    offset: int = 0,
    compile_mask: bool = True,
    window: int | None = None,
    blocks: torch.Tensor | None = None,
):
    """FlexAttention ``BlockMask``: query ``offset + q`` sees key ``k`` iff both lie in the same segment and
    ``k <= offset + q`` or, with ``blocks`` (``[B, K]`` block id per key, -1 none: ``block_ids``), both lie in one
    block (and, with ``window``, ``offset + q - k < window``). Built on ``segment_ids``' device without a host sync."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, keys = segment_ids.shape

    def mask_mod(batch, head, q, kv):
        q_abs = q + offset
        visible = kv <= q_abs
        if blocks is not None:
            visible = visible | ((blocks[batch, q_abs] == blocks[batch, kv]) & (blocks[batch, q_abs] >= 0))
        return (segment_ids[batch, q_abs] == segment_ids[batch, kv]) & visible

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


def chunk_ids(segment_ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, K]`` ids whose maximal runs are ``segment_ids``' runs cut every ``chunk`` columns from each run's start
    (Llama 4's attention chunks of each sample): one id per (run, chunk). On the tensor's device, no sync."""
    cols = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = F.pad(segment_ids[:, 1:] != segment_ids[:, :-1], (1, 0), value=True)
    run = torch.cumsum(starts.long(), dim=1)
    run_start = torch.cummax(torch.where(starts, cols, 0), dim=1).values
    stride = segment_ids.shape[1] // chunk + 1
    return run * stride + (cols - run_start) // chunk


def block_ids(bidirectional: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` id of each position's bidirectional block (its maximal run of True, numbered from 0 along the row;
    -1 outside any): HF Gemma 3's ``get_block_sequence_ids_for_mask``. On the tensor's device, no sync."""
    previous = F.pad(bidirectional, (1, 0), value=False)[:, :-1]
    ids = torch.cumsum((bidirectional & ~previous).int(), dim=1) - 1
    return torch.where(bidirectional, ids, -1)


def _chunks(s: int, e: int, offset: int, blocks: list[tuple[int, int]]) -> list[tuple[int, int, int, int, bool]]:
    """Spans ``(q0, q1, k0, k1, full)`` of segment ``[s, e)``'s queries at or after ``offset``: text runs causal,
    each block (a run of ``blocks`` inside the segment) ``full`` against the segment's keys up to its end."""
    inside = [(max(a, s), min(b, e)) for a, b in blocks if a < e and b > s]
    cuts, spans, at = [], [], s
    for a, b in inside:
        if at < a:
            cuts.append((at, a, False))
        cuts.append((a, b, True))
        at = b
    if at < e:
        cuts.append((at, e, False))
    for a, b, full in cuts:
        if b > offset:
            spans.append((max(a, offset) - offset, b - offset, s, b, full))
    return spans


@dataclass
class AttentionPlan:
    """How every layer of one forward attends. Build with ``plan_attention``; call ``attend(q, k, v)``.

    q ``[B, H, Sq, D]``, k/v ``[B, Hkv, Sk, D]`` (Hkv may divide H: GQA, never expanded to H here).
    """

    kind: str  # causal | causal_lower_right | flex | segments | key_padding
    block_mask: object | None = None  # flex
    # segments: per row, (q0, q1, k0, k1, full): queries [q0, q1) against keys [k0, k1), causal lower-right aligned
    # or, ``full``, every key (a bidirectional block)
    spans: list[list[tuple[int, int, int, int, bool]]] | None = None
    mask: torch.Tensor | None = None  # key_padding: [B, 1, 1, K] bool (the window already applied)
    window: int | None = None  # sliding window in tokens (None: no limit)
    scale: float | None = None  # softmax scale of the scores (None: head_dim ** -0.5)
    tiled: bool = True  # segments: each row's spans tile its queries and keys alike (no chunks, no blocks)
    # context parallelism: keys/values ``[B, Hkv, S_local, D]`` → the whole rows' ``[B, Hkv, S, D]`` (a collective)
    gather: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    # hybrid decoders: packed rows' samples as rows of their own for the linear-attention layers
    # (``neva.models.gated_deltanet.PackedRows``; None: each row is one sequence)
    recurrent: object | None = None
    # Llama 4's temperature-tuned layers: ``[B, 1, Sq, 1]`` fp32 factor of each query (None: none)
    query_scale: torch.Tensor | None = None
    # shared prompts: per row, the prompt's columns ``[0, p)`` every later non-padding span also attends (None: none)
    prefixes: list[tuple[int, set[int]]] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if self.query_scale is not None:  # in fp32, cast back (as HF scales them)
            q = (q * self.query_scale).to(q.dtype)
        if self.gather is not None:  # one collective for keys and values
            k, v = self.gather(torch.stack([k, v]), 3).unbind(0)
        if self.kind in ("causal", "causal_lower_right"):
            return _causal(q, k, v, gqa, self.window, self.scale)
        if self.kind == "key_padding":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa, scale=self.scale)
        if self.kind == "flex":
            return _flex(q, k, v, self.block_mask, gqa, self.scale)
        return _per_segment(q, k, v, self.spans, gqa, self.window, self.scale, self.tiled, self.prefixes)


def _causal(q, k, v, gqa: bool, window: int | None, scale: float | None = None, full: bool = False) -> torch.Tensor:
    """Causal attention of the last ``Sq`` of ``Sk`` positions (lower-right aligned; top-left when Sq == Sk), within
    ``window``; ``full``: every key up to the window (a bidirectional block's queries, the block ending the keys)."""
    q_len, k_len = q.shape[2], k.shape[2]
    if window is None or k_len <= window:  # no query can see more than the window
        if full or q_len == 1:  # a block's queries, or one query after the cache, see every key
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=scale)
        if q_len == k_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    # A [Sq, Sk] mask broadcast over batch and heads (cached chunked prefill, or a window; never [B, H, S, S]).
    ones = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
    mask = ones if full else ones.tril(diagonal=k_len - q_len)
    if window is not None:
        mask = mask & ~ones.tril(diagonal=k_len - q_len - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


def _flex(q, k, v, block_mask, gqa: bool, scale: float | None = None) -> torch.Tensor:
    if torch.is_autocast_enabled(q.device.type):
        # SDPA casts under autocast; FlexAttention does not, and wants one dtype for q, k and v.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return _flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa, scale=scale)


@torch.compiler.disable  # the span list changes every batch: compiling it would recompile per batch
def _per_segment(
    q, k, v, spans, gqa: bool, window: int | None = None, scale: float | None = None, tiled: bool = True,
    prefixes: list[tuple[int, set[int]]] | None = None,
) -> torch.Tensor:  # fmt: skip
    if q.shape[2] == k.shape[2] and tiled and prefixes is None:
        # No cache: each row's spans tile it, for queries and keys alike. ``split`` (not slicing) keeps backward to
        # one concatenation per row instead of a zero-filled full-size gradient per segment.
        # Outputs are concatenated token-major ([B, S, H, D] memory, returned as its [B, H, S, D] view): the caller's
        # transpose back to tokens and merge of the heads is then a view, not another copy.
        rows = []
        for q_r, k_r, v_r, row_spans in zip(q.unbind(0), k.unbind(0), v.unbind(0), spans):
            sizes = [span[1] - span[0] for span in row_spans]
            outs = [
                _causal(qi[None], ki[None], vi[None], gqa, window, scale)
                for qi, ki, vi in zip(q_r.split(sizes, 1), k_r.split(sizes, 1), v_r.split(sizes, 1))
            ]
            rows.append(torch.cat([o.transpose(1, 2) for o in outs], dim=1))
        return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)).transpose(1, 2)
    rows = []
    for r, row_spans in enumerate(spans):
        outs = []
        prompt, sharing = prefixes[r] if prefixes is not None else (0, set())
        for qs, qe, ks, ke, full in row_spans:
            qi, ki, vi = q[r : r + 1, :, qs:qe], k[r : r + 1, :, ks:ke], v[r : r + 1, :, ks:ke]
            if ks in sharing:  # a completion after the shared prompt: the prompt's keys, then its own
                ki = torch.cat([k[r : r + 1, :, :prompt], ki], dim=2)
                vi = torch.cat([v[r : r + 1, :, :prompt], vi], dim=2)
            # Queries after cached keys of their segment (or after a chunk's earlier keys) align lower-right.
            outs.append(_causal(qi, ki, vi, gqa, window, scale, full))
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
    scale: float | None = None,
    bidirectional: torch.Tensor | None = None,
    batch: int = 1,
    chunk: int | None = None,
    shared_prefix: bool = False,
) -> AttentionPlan:
    """The attention of one forward over ``q_len`` new tokens after ``offset`` cached ones.

    Args:
        segment_ids: ``[B, offset + q_len]`` sample id per key position (0 = padding), or None (one causal sequence
            per row; right padding allowed).
        device: where the activations are; CUDA training takes FlexAttention.
        window: sliding window (a query sees itself and ``window - 1`` earlier keys), or None.
        shard: context parallelism: the ``q_len`` queries are this rank's columns of longer rows (``segment_ids`` is
            then ignored: the shard carries the whole rows').
        scale: the scores' softmax scale (None: SDPA's ``head_dim ** -0.5``).
        bidirectional: ``[M, 2]`` (row, column among the new tokens) of the positions whose maximal runs attend both
            ways (Gemma 3's image tokens), or None. Read on the host per segment (the collator's positions are host
            tensors: no sync, and the fake-tensor rehearsal keeps their values), on the device for FlexAttention.
        batch: rows (``B``), where ``segment_ids`` is None and blocks need them.
        chunk: chunked attention (Llama 4): a query sees only the keys of its own ``chunk``-token chunk of its
            segment (chunks counted from the segment's first column), or None. Each chunk is then a segment of its
            own, which every path below attends as it attends segments.
        shared_prefix: each row's first segment is a prompt that every later non-padding segment of the row attends
            before its own keys (see the module docstring); training forwards only (no cache, no shard, no chunks).

    Raises:
        ValueError: bidirectional blocks or chunks under context parallelism (a shard's chunks do not hold whole
            blocks; its gathered keys are not split by chunk); shared prefixes with a cache, a shard or chunks.
    """
    if shared_prefix:
        if offset or shard is not None or chunk is not None or segment_ids is None:
            raise ValueError("shared-prompt rows need segment ids and take no cache, context shard or chunks")
        return _plan_shared_prefix(segment_ids, window, scale, bidirectional)
    if bidirectional is not None and (q_len == 1 or bidirectional.shape[0] == 0):
        bidirectional = None  # one new query is text (the blocks before it change nothing), or no image at all
    if shard is not None:
        if bidirectional is not None:
            raise ValueError("bidirectional attention blocks (Gemma 3's images) under context parallelism")
        if chunk is not None:
            raise ValueError("chunked attention (Llama 4) under context parallelism")
        return _plan_shard(shard, window, device, scale)
    keys = offset + q_len
    if segment_ids is None and bidirectional is None and chunk is None:
        return AttentionPlan("causal" if offset == 0 else "causal_lower_right", window=window, scale=scale)
    if q_len == 1:
        seg = segment_ids if segment_ids is not None else torch.ones(batch, keys, dtype=torch.long, device=device)
        if chunk is not None:
            seg = chunk_ids(seg, chunk)
        mask = seg == seg[:, -1:]
        if window is not None and seg.shape[1] > window:
            mask[:, : seg.shape[1] - window] = False
        return AttentionPlan("key_padding", mask=mask[:, None, None, :], window=window, scale=scale)
    if not attends_per_segment(device) and offset == 0:
        if segment_ids is None:  # one sequence per row, its blocks (or chunks) still need the mask_mod
            segment_ids = torch.ones(batch, keys, dtype=torch.long, device=device)
        if chunk is not None:
            segment_ids = chunk_ids(segment_ids, chunk)
        blocks = None
        if bidirectional is not None:
            pos = bidirectional.to(device)
            flags = torch.zeros(segment_ids.shape, dtype=torch.bool, device=device)
            blocks = block_ids(flags.index_put((pos[:, 0], pos[:, 1]), torch.ones((), dtype=torch.bool, device=device)))
        block_mask = document_causal_block_mask(segment_ids, q_len, window=window, blocks=blocks)
        return AttentionPlan("flex", block_mask=block_mask, window=window, scale=scale)
    rows = segment_runs(segment_ids) if segment_ids is not None else [[(0, keys)] for _ in range(batch)]
    if chunk is not None:
        rows = [[(a, min(a + chunk, e)) for s, e in runs for a in range(s, e, chunk)] for runs in rows]
    blocks = _host_runs(bidirectional, len(rows), offset)
    spans = []
    for runs, row_blocks in zip(rows, blocks):
        # Keys of a run up to the last query in it; queries are the run's positions at or after ``offset``.
        spans.append([span for s, e in runs if e > offset for span in _chunks(s, e, offset, row_blocks)])
    return AttentionPlan("segments", spans=spans, window=window, scale=scale, tiled=not any(blocks))


def _plan_shared_prefix(
    segment_ids: torch.Tensor, window: int | None, scale: float | None, bidirectional: torch.Tensor | None
) -> AttentionPlan:
    """Per-segment spans of shared-prompt rows: the prompt (the first run; its bidirectional blocks, if any, as
    ``_chunks`` cuts them) attends itself, every later run that is not padding attends the prompt and itself."""
    rows = segment_runs(segment_ids)
    blocks = _host_runs(bidirectional, len(rows), 0)
    spans, prefixes = [], []
    for runs, ids, row_blocks in zip(rows, segment_ids.tolist(), blocks):
        prompt = runs[0][1]
        spans.append([span for s, e in runs for span in _chunks(s, e, 0, row_blocks)])
        prefixes.append((prompt, {s for s, _ in runs[1:] if ids[s] != 0}))
    return AttentionPlan("segments", spans=spans, window=window, scale=scale, tiled=False, prefixes=prefixes)


def _host_runs(positions: torch.Tensor | None, rows: int, offset: int) -> list[list[tuple[int, int]]]:
    """Per row, the ``(start, end)`` key columns of each maximal run of ``positions`` (read as Python integers: see
    ``segment_runs``), the new tokens' columns shifted by ``offset``."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    if positions is None:
        return out
    columns: list[list[int]] = [[] for _ in range(rows)]
    for r, c in positions.tolist():
        columns[r].append(c + offset)
    for r, cols in enumerate(columns):
        for c in sorted(cols):
            if out[r] and out[r][-1][1] == c:
                out[r][-1] = (out[r][-1][0], c + 1)
            else:
                out[r].append((c, c + 1))
    return out


def shard_mask_mod(columns: torch.Tensor, segment_ids: torch.Tensor, window: int | None = None):
    """FlexAttention ``mask_mod`` of a context-parallel shard: local query ``q`` (global column ``columns[q]``) sees
    gathered key ``kv`` iff both lie in the same segment, ``kv <= columns[q]`` (and, with ``window``, within it)."""

    def mask_mod(batch, head, q, kv):
        q_abs = columns[q]
        visible = (segment_ids[batch, q_abs] == segment_ids[batch, kv]) & (kv <= q_abs)
        return visible if window is None else visible & (q_abs - kv < window)

    return mask_mod


def _plan_shard(
    shard: ContextShard, window: int | None, device: torch.device, scale: float | None = None
) -> AttentionPlan:
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
        return AttentionPlan("flex", block_mask=block_mask, window=window, scale=scale, gather=shard.gather_sequence)
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
                    row.append((local + a - g0, local + b - g0, s, b, False))
        spans.append(row)
    return AttentionPlan("segments", spans=spans, window=window, scale=scale, tiled=False, gather=shard.gather_sequence)
