"""Sliding-window attention on every path of neva.models.attention against a dense windowed segment-causal mask."""

import pytest
import torch
import torch.nn.functional as F

from neva.models.attention import document_causal_block_mask, plan_attention
from tests.models.test_attention import SEGMENTS, S, assert_same_outputs_and_grads, qkv

WINDOW = 8


def windowed_reference(q, k, v, segment_ids, offset=0, window=WINDOW):
    """Dense ``[B, 1, Sq, K]`` mask: same segment, causal, and at most ``window - 1`` keys back (HF Mistral's rule:
    ``kv > q - window``)."""
    q_len, keys = q.shape[2], segment_ids.shape[1]
    same = segment_ids[:, offset : offset + q_len, None] == segment_ids[:, None, :]
    q_abs, kv = torch.arange(offset, offset + q_len)[:, None], torch.arange(keys)[None, :]
    allowed = (kv <= q_abs) & (kv > q_abs - window)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(same & allowed)[:, None])


def test_packed_rows_within_the_window():
    plan = plan_attention(SEGMENTS, S, 0, torch.device("cpu"), window=WINDOW)
    assert plan.kind == "segments"
    ref = lambda q, k, v: windowed_reference(q, k, v, SEGMENTS)  # noqa: E731
    assert_same_outputs_and_grads(plan.attend, ref, qkv(4, 2))


def test_unpacked_rows_within_the_window():
    plan = plan_attention(None, S, 0, torch.device("cpu"), window=WINDOW)
    ones = torch.ones(2, S, dtype=torch.long)
    assert_same_outputs_and_grads(plan.attend, lambda q, k, v: windowed_reference(q, k, v, ones), qkv(4, 2))


@pytest.mark.parametrize("q_len", [1, 5])
def test_cached_queries_within_the_window(q_len):
    """Generation: left-padded rows, ``q_len`` new queries after 11 cached keys (more than the window)."""
    keys = 11 + q_len
    segments = torch.tensor([[0] * 3 + [1] * (keys - 3), [1] * keys])
    plan = plan_attention(segments, q_len, 11, torch.device("cpu"), window=WINDOW)
    ref = lambda q, k, v: windowed_reference(q, k, v, segments, offset=11)  # noqa: E731
    assert_same_outputs_and_grads(plan.attend, ref, qkv(4, 2, q_len, keys))
    no_segments = plan_attention(None, q_len, 11, torch.device("cpu"), window=WINDOW)
    ones = torch.ones(2, keys, dtype=torch.long)
    ref = lambda q, k, v: windowed_reference(q, k, v, ones, offset=11)  # noqa: E731
    assert_same_outputs_and_grads(no_segments.attend, ref, qkv(4, 2, q_len, keys))


def test_flex_block_mask_within_the_window():
    """The CUDA path's BlockMask (mask_mod with the window), run by FlexAttention's reference path on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = document_causal_block_mask(SEGMENTS, S, compile_mask=False, window=WINDOW)
    q, k, v = (t.detach() for t in qkv(4, 2))
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, windowed_reference(q, k, v, SEGMENTS))
