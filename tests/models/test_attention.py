"""Attention without dense masks (neva.models.attention) against the dense segment-causal mask it replaced."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from neva.models.attention import document_causal_block_mask, plan_attention, segment_runs
from neva.models.config import LLMConfig
from neva.models.llama import LlamaDecoder

# Two packed rows: samples of 20, 17 and 5 tokens then padding; one sample of 30 then padding. Row length S = 48
# differs from every other dimension, so an [.., S, S] tensor is recognisable by shape.
S = 48
SEGMENTS = torch.tensor([[1] * 20 + [2] * 17 + [3] * 5 + [0] * 6, [1] * 30 + [0] * 18])


def dense_reference(q, k, v, segment_ids, offset=0):
    """The old path: a boolean ``[B, 1, Sq, K]`` mask (causal, same segment; padding sees padding) + math SDPA with
    K/V expanded to all heads."""
    q_len, keys = q.shape[2], segment_ids.shape[1]
    same = segment_ids[:, offset : offset + q_len, None] == segment_ids[:, None, :]
    causal = torch.arange(keys)[None, :] <= torch.arange(offset, offset + q_len)[:, None]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(same & causal)[:, None])


def qkv(heads, kv_heads, q_len=S, k_len=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, q_len, 8, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, k_len, 8, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, k_len, 8, generator=g, requires_grad=True)
    return q, k, v


def assert_same_outputs_and_grads(fn, ref, tensors, keep=None):
    """Equal outputs (where ``keep`` [B, Sq]) and equal input gradients of a loss on those outputs."""
    out, expected = fn(*tensors), ref(*tensors)
    w = torch.randn_like(expected)
    if keep is not None:
        w = w * keep[:, None, :, None]
        torch.testing.assert_close(out * keep[:, None, :, None], expected * keep[:, None, :, None])
    else:
        torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad((out * w).sum(), tensors)
    expected_grads = torch.autograd.grad((expected * w).sum(), tensors)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


def test_segment_runs():
    assert segment_runs(SEGMENTS) == [[(0, 20), (20, 37), (37, 42), (42, 48)], [(0, 30), (30, 48)]]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_packed_rows_equal_dense_mask(kv_heads):
    plan = plan_attention(SEGMENTS, S, 0, torch.device("cpu"))
    assert plan.kind == "segments"
    assert_same_outputs_and_grads(plan.attend, lambda q, k, v: dense_reference(q, k, v, SEGMENTS), qkv(4, kv_heads))


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_right_padded_rows_are_plain_causal(kv_heads):
    """Unpacked rows take ``is_causal`` with no mask: equal to the dense mask at every real token (padding follows
    all real tokens; its outputs carry no loss)."""
    segments = torch.tensor([[1] * 40 + [0] * 8, [1] * S])
    plan = plan_attention(None, S, 0, torch.device("cpu"))
    keep = (segments > 0).float()
    assert_same_outputs_and_grads(
        plan.attend, lambda q, k, v: dense_reference(q, k, v, segments), qkv(4, kv_heads), keep=keep
    )


@pytest.mark.parametrize("q_len", [1, 5])
def test_cached_queries_equal_dense_mask(q_len):
    """Generation: left-padded rows, ``q_len`` new queries after 11 cached keys (decode step and chunked prefill)."""
    keys = 11 + q_len
    segments = torch.tensor([[0] * 3 + [1] * (keys - 3), [1] * keys])
    plan = plan_attention(segments, q_len, 11, torch.device("cpu"))
    assert plan.kind == ("key_padding" if q_len == 1 else "segments")
    ref = lambda q, k, v: dense_reference(q, k, v, segments, offset=11)  # noqa: E731
    assert_same_outputs_and_grads(plan.attend, ref, qkv(4, 2, q_len, keys))
    no_segments = plan_attention(None, q_len, 11, torch.device("cpu"))
    ref = lambda q, k, v: dense_reference(q, k, v, torch.ones(2, keys, dtype=torch.long), offset=11)  # noqa: E731
    assert_same_outputs_and_grads(no_segments.attend, ref, qkv(4, 2, q_len, keys))


def test_flex_document_mask_equals_dense_mask():
    """The CUDA path's BlockMask, run by FlexAttention's reference implementation on CPU (forward)."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = document_causal_block_mask(SEGMENTS, S, compile_mask=False)
    q, k, v = (t.detach() for t in qkv(4, 2))  # FlexAttention has no backward on CPU
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, dense_reference(q, k, v, SEGMENTS))


def tiny_gqa_decoder() -> LlamaDecoder:
    torch.manual_seed(0)
    cfg = LLMConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2)
    model = LlamaDecoder(cfg)
    model.init_weights()
    return model


def packed_inputs():
    ids = torch.randint(0, 61, (2, S), generator=torch.Generator().manual_seed(1))
    positions = torch.zeros_like(SEGMENTS)
    for r, runs in enumerate(segment_runs(SEGMENTS)):
        for s, e in runs:
            positions[r, s:e] = torch.arange(e - s)
    return ids, positions


def test_packed_decoder_loss_and_grads_equal_separate_samples():
    """Model level, GQA: a packed batch's summed loss and parameter gradients equal those of its samples run one by
    one (an independent reference: no mask at all)."""
    model = tiny_gqa_decoder()
    ids, positions = packed_inputs()

    def loss_of(tokens, pos=None, seg=None):
        logits = model(model.tok_embeddings(tokens), position_ids=pos, segment_ids=seg)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")

    per_token = loss_of(ids, positions, SEGMENTS)
    learned = torch.zeros_like(per_token.view(2, S - 1), dtype=torch.bool)
    expected = torch.zeros(())
    for r, runs in enumerate(segment_runs(SEGMENTS)):
        for s, e in runs:
            if SEGMENTS[r, s] > 0:
                learned[r, s : e - 1] = True  # targets inside the sample only
                expected = expected + loss_of(ids[r : r + 1, s:e]).sum()
    got = per_token[learned.flatten()].sum()
    grads = torch.autograd.grad(got, list(model.parameters()))
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


class ShapeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_gqa_packing_never_builds_a_row_square():
    """No tensor produced in forward or backward has an ``[S, S]`` tail (no dense mask, no [B, H, S, S] scores)."""
    model = tiny_gqa_decoder()
    ids, positions = packed_inputs()
    with ShapeRecorder() as rec:
        model(model.tok_embeddings(ids), position_ids=positions, segment_ids=SEGMENTS).sum().backward()
    assert len(rec.shapes) > 100
    squares = [s for s in rec.shapes if len(s) >= 2 and s[-2:] == (S, S)]
    assert not squares, squares
    # The dense path has (its mask at least): the recorder sees it.
    with ShapeRecorder() as rec:
        dense_reference(*qkv(4, 2), SEGMENTS)
    assert any(s[-2:] == (S, S) for s in rec.shapes)


@pytest.mark.parametrize("window", [None, 9], ids=["full", "window"])
def test_shared_prompt_rows_equal_dense_mask(window):
    """Shared-prompt rows (the online RL stage's groups, ``shared_prefix``): each later segment attends the row's
    first one (the prompt; here with a bidirectional block, Gemma 3's image) and itself, as a row of its own after the
    prompt would: a dense mask over the positions each column has in its separate row (the window counts those), GQA."""
    segments = torch.tensor([[1] * 12 + [2] * 7 + [3] * 4 + [4] * 9 + [0] * 16, [1] * 20 + [2] * 15 + [3] * 13])
    blocks = torch.tensor([[0, c] for c in range(3, 7)] + [[1, c] for c in range(2, 10)])
    plan = plan_attention(segments, S, 0, torch.device("cpu"), window=window, shared_prefix=True,
                          bidirectional=blocks)  # fmt: skip
    assert plan.kind == "segments"
    cols = torch.arange(S)
    prompt = (segments == 1).sum(1, keepdim=True)
    starts = torch.stack([torch.tensor([min(c for c in range(S) if segments[r, c] == segments[r, j]) for j in range(S)])
                          for r in range(2)])  # fmt: skip
    pos = torch.where(cols < prompt, cols, prompt + cols - starts)  # each column's position in its own row
    sq, sk = segments[:, :, None], segments[:, None, :]
    same = (sq == sk) & (cols[None, None, :] <= cols[None, :, None])
    shared = (sk == 1) & (sq > 1)
    block = torch.full((2, S), -1)
    block[blocks[:, 0], blocks[:, 1]] = blocks[:, 0]
    both = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
    mask = same | shared | both
    if window is not None:
        mask &= pos[:, :, None] - pos[:, None, :] < window
    q, k, v = qkv(4, 2)

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=mask[:, None])  # fmt: skip

    assert_same_outputs_and_grads(plan.attend, dense, (q, k, v))
    with pytest.raises(ValueError, match="shared-prompt"):
        plan_attention(segments, 1, S - 1, torch.device("cpu"), shared_prefix=True)
