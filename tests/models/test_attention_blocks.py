"""Bidirectional blocks (Gemma 3's images) in the attention plan against a dense mask written from HF's rule:
``same segment & (causal | same block) & within the window``, blocks the maximal runs of image positions. The CPU
per-segment path (outputs and gradients), a cached prefill, and the CUDA path's BlockMask (run by FlexAttention's
reference implementation on CPU, forward)."""

import pytest
import torch
import torch.nn.functional as F

from neva.models.attention import block_ids, document_causal_block_mask, plan_attention
from tests.models.test_attention import SEGMENTS, S, assert_same_outputs_and_grads, qkv

# Image runs: row 0 one inside sample 1, one starting sample 2, one at the end of sample 2 right before sample 3;
# row 1 one of 9 (wider than the window), then padding.
IMAGES = torch.zeros(2, S, dtype=torch.bool)
IMAGES[0, 3:7] = IMAGES[0, 20:24] = IMAGES[0, 33:37] = True
IMAGES[1, 10:19] = True
POSITIONS = IMAGES.nonzero()  # what the model hands the plan: [M, 2] (row, column)


def dense_blocks(q, k, v, segment_ids, images, window=None, offset=0, scale=None):
    """HF's rule as one dense ``[B, 1, Sq, K]`` mask: the blocks are ``get_block_sequence_ids_for_mask``'s."""
    q_len, keys = q.shape[2], segment_ids.shape[1]
    rows, cols = torch.arange(offset, offset + q_len)[:, None], torch.arange(keys)[None, :]
    same = segment_ids[:, offset : offset + q_len, None] == segment_ids[:, None, :]
    start = images & ~F.pad(images, (1, 0))[:, :-1]
    ids = torch.where(images, start.int().cumsum(1) - 1, -1)
    block = (ids[:, offset : offset + q_len, None] == ids[:, None, :]) & (ids[:, offset : offset + q_len, None] >= 0)
    mask = same & ((cols <= rows) | block)
    if window is not None:
        mask &= rows - cols < window
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)


@pytest.mark.parametrize("window", [None, 6], ids=["global", "sliding"])
@pytest.mark.parametrize("segments", [True, False], ids=["packed", "one_sequence"])
def test_blocks_equal_the_dense_rule(window, segments):
    seg = SEGMENTS if segments else None
    ref_seg = SEGMENTS if segments else torch.ones_like(SEGMENTS)
    plan = plan_attention(seg, S, 0, torch.device("cpu"), window, scale=0.3, bidirectional=POSITIONS, batch=2)
    assert plan.kind == "segments" and not plan.tiled

    def ref(q, k, v):
        return dense_blocks(q, k, v, ref_seg, IMAGES, window, scale=0.3)

    assert_same_outputs_and_grads(plan.attend, ref, qkv(4, 2))


def test_prefill_after_cached_tokens_and_one_decoded_query():
    """Queries from position 30 on (the plan gets the new tokens' image positions: a cached block changes nothing for
    later queries, which see it causally), then one decoded text query (blocks change nothing for it)."""
    offset = 30
    for q_len in (S - offset, 1):
        new = IMAGES[:, S - q_len :].nonzero()  # columns among the new tokens
        plan = plan_attention(SEGMENTS, q_len, S - q_len, torch.device("cpu"), window=6, bidirectional=new)
        q, k, v = (t.detach() for t in qkv(4, 2, q_len, S))
        expected = dense_blocks(q, k, v, SEGMENTS, IMAGES, 6, offset=S - q_len)
        torch.testing.assert_close(plan.attend(q, k, v), expected)


def test_flex_block_mask_equals_the_dense_rule():
    """The CUDA path's BlockMask (``mask_mod`` with the block ids) on FlexAttention's reference implementation."""
    from torch.nn.attention.flex_attention import flex_attention

    # with the window: every clause of the rule (a row-1 block is wider than it)
    mask = document_causal_block_mask(SEGMENTS, S, compile_mask=False, window=6, blocks=block_ids(IMAGES))
    q, k, v = (t.detach() for t in qkv(4, 2))
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, dense_blocks(q, k, v, SEGMENTS, IMAGES, 6))
