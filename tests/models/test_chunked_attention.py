"""Chunked attention (Llama 4's ``chunked_attention`` layers: a query sees its own ``chunk``-token chunk of its
sample, chunks counted from the sample's first token) on every attention path, against a dense mask built here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neva.models.attention import chunk_ids, document_causal_block_mask, plan_attention
from tests.models.test_attention import SEGMENTS, S, assert_same_outputs_and_grads, qkv

CHUNK = 8


def _positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Each column's position in its run of equal ids."""
    out = torch.zeros_like(segment_ids)
    for r, row in enumerate(segment_ids.tolist()):
        for c in range(1, len(row)):
            out[r, c] = out[r, c - 1] + 1 if row[c] == row[c - 1] else 0
    return out


def dense_chunked(q, k, v, segment_ids, offset=0):
    """A boolean ``[B, 1, Sq, K]`` mask: causal, same segment, same chunk of the segment; math SDPA on expanded K/V."""
    q_len, keys = q.shape[2], segment_ids.shape[1]
    chunk = _positions(segment_ids) // CHUNK
    rows = slice(offset, offset + q_len)
    same = (segment_ids[:, rows, None] == segment_ids[:, None, :]) & (chunk[:, rows, None] == chunk[:, None, :])
    causal = torch.arange(keys)[None, :] <= torch.arange(offset, offset + q_len)[:, None]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(same & causal)[:, None])


def test_chunk_ids_cut_each_run_from_its_start():
    ids = chunk_ids(torch.tensor([[0, 0, 1, 1, 1, 1, 1, 2, 2]]), 3)[0].tolist()
    # runs: [0, 2) [2, 7) [7, 9); chunks of 3 from each run's start
    assert [len(set(ids[a:b])) for a, b in ((0, 2), (2, 5), (5, 7), (7, 9))] == [1, 1, 1, 1]
    assert len(set(ids)) == 4


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_packed_rows_attend_within_their_chunks(kv_heads):
    plan = plan_attention(SEGMENTS, S, 0, torch.device("cpu"), chunk=CHUNK)
    ref = lambda q, k, v: dense_chunked(q, k, v, SEGMENTS)  # noqa: E731
    assert_same_outputs_and_grads(plan.attend, ref, qkv(4, kv_heads))


def test_unpacked_rows_attend_within_their_chunks():
    plan = plan_attention(None, S, 0, torch.device("cpu"), chunk=CHUNK, batch=2)
    ref = lambda q, k, v: dense_chunked(q, k, v, torch.ones(2, S, dtype=torch.long))  # noqa: E731
    assert_same_outputs_and_grads(plan.attend, ref, qkv(4, 2))


@pytest.mark.parametrize("q_len", [1, 5])
def test_cached_queries_attend_within_their_chunks(q_len):
    """Generation: a left-padded row and a full one, ``q_len`` new queries after 11 cached keys."""
    keys = 11 + q_len
    segments = torch.tensor([[0] * 3 + [1] * (keys - 3), [1] * keys])
    plan = plan_attention(segments, q_len, 11, torch.device("cpu"), chunk=CHUNK)
    ref = lambda q, k, v: dense_chunked(q, k, v, segments, offset=11)  # noqa: E731
    assert_same_outputs_and_grads(plan.attend, ref, qkv(4, 2, q_len, keys))
    no_segments = plan_attention(None, q_len, 11, torch.device("cpu"), chunk=CHUNK, batch=2)
    ones = torch.ones(2, keys, dtype=torch.long)
    ref = lambda q, k, v: dense_chunked(q, k, v, ones, offset=11)  # noqa: E731
    assert_same_outputs_and_grads(no_segments.attend, ref, qkv(4, 2, q_len, keys))


def test_flex_chunk_mask_equals_dense_mask():
    """The CUDA path's BlockMask over the chunk ids, run by FlexAttention's reference implementation on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = document_causal_block_mask(chunk_ids(SEGMENTS, CHUNK), S, compile_mask=False)
    q, k, v = (t.detach() for t in qkv(4, 2))
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, dense_chunked(q, k, v, SEGMENTS))


def test_context_parallel_refused():
    from neva.models.context_shard import ContextShard

    with pytest.raises(ValueError, match="chunked attention"):
        plan_attention(None, S, 0, torch.device("cpu"), shard=object.__new__(ContextShard), chunk=CHUNK)
