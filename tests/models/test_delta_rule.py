"""The chunked delta rule's hand-written backwards (``neva.models.delta_rule``: the state chain, the chunks' unit
lower-triangular inverse) against numerical gradients (fp64), and the rule on packed rows with a starting state
against transformers' token-by-token recurrence run on each sample (fp32): outputs, final states and every input's
gradient, the starting state's too."""

from __future__ import annotations

import torch

from neva.models.delta_rule import _StateChain, _UnitLowerInverse, chunked_delta_rule
from tests.checkpoint.tiny_hf import one_thread
from tests.models.test_hf_parity import rel_err


def test_state_chain_backward_equals_numerical_gradients():
    """Two rows, two heads, three chunks; the second row's state reset at its second chunk (then: the first row's
    at its first, the second's at its second and third): gradients of every output (starting states, corrections,
    final state) with respect to every input, fp64."""
    g = torch.Generator().manual_seed(0)
    b, heads, n, c, dk, dv = 2, 2, 3, 4, 3, 2

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    u, w, k_to_end = rand(b, heads, n, c, dv), rand(b, heads, n, c, dk), rand(b, heads, n, dk, c)
    decays = (torch.rand(b, heads, n, 1, 1, generator=g, dtype=torch.float64) * 0.9 + 0.1).requires_grad_()
    initial = rand(b, heads, dk, dv)
    keep = torch.tensor([[True, True, True], [True, False, True]])
    # a row whose first chunk resets (its initial state unused) and a one-chunk run between two resets
    resets_first = torch.tensor([[False, True, True], [True, False, False]])
    for kept in (None, keep, resets_first):
        assert torch.autograd.gradcheck(
            lambda *args, kept=kept: _StateChain.apply(*args, kept), (u, w, k_to_end, decays, initial)
        )  # fmt: skip


def test_unit_lower_inverse_backward_equals_numerical_gradients():
    """A full ``[2, 5, 5]`` input (its diagonal and upper part ignored: their gradients zero), fp64."""
    system = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.5
    assert torch.autograd.gradcheck(_UnitLowerInverse.apply, (system.requires_grad_(),))


def _sample_reference(q, k, v, g, beta, state):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as reference

    return reference(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


def test_packed_rows_from_a_starting_state_equal_the_token_recurrence():
    """Rows of 5 chunks of 8 laid out as ``PackedRows`` lays packed samples (each sample from a zero state at a
    chunk start, the gap after it with ``beta = g = 0``); the first sample of each row continues a given state. Two
    value heads per key head. Outputs and final states = transformers' recurrence over each sample, and gradients
    of q, k, v, g, beta (at the samples' tokens) and the starting state ≤ 1e-5."""
    chunk, width = 8, 40
    samples = [[(0, 11), (16, 37)], [(0, 5), (8, 30), (32, 40)]]  # (start, end) of each row's samples
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, width, 1, 6, generator=gen) for _ in range(2))
    v = torch.randn(2, width, 2, 5, generator=gen)
    g = -torch.rand(2, width, 2, generator=gen) * 2
    beta = torch.rand(2, width, 2, generator=gen)
    real = torch.zeros(2, width, dtype=torch.bool)
    for r, runs in enumerate(samples):
        for start, end in runs:
            real[r, start:end] = True
    g, beta = g * real[..., None], beta * real[..., None]  # the gaps leave the state alone
    resets = torch.zeros(2, width // chunk, dtype=torch.bool)
    for r, runs in enumerate(samples):
        for start, _ in runs[1:]:
            resets[r, start // chunk] = True
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, torch.randn(2, 2, 6, 5, generator=gen))]
    weights = torch.randn(2, width, 2, 5, generator=gen), torch.randn(2, 2, 6, 5, generator=gen)
    with one_thread():
        ours, state = chunked_delta_rule(*inputs[:5], inputs[5], chunk=chunk, resets=resets)
        ours = ours * real[..., None, None]  # the gaps' outputs are dropped (``PackedRows.join``)
        theirs, their_states = torch.zeros_like(ours), []
        for r, runs in enumerate(samples):
            for i, (start, end) in enumerate(runs):
                part = [t[r : r + 1, start:end] for t in inputs[:5]]
                first = inputs[5][r : r + 1] if i == 0 else None
                out, last = _sample_reference(*part, first)
                theirs = theirs.index_put((torch.tensor([r]), torch.arange(start, end)), out[0])
            their_states.append(last[0])
        their_state = torch.stack(their_states)
        assert rel_err(ours, theirs) < 1e-5 and rel_err(state, their_state) < 1e-5
        ours_grads = torch.autograd.grad((ours * weights[0]).sum() + (state * weights[1]).sum(), inputs)
        their_grads = torch.autograd.grad((theirs * weights[0]).sum() + (their_state * weights[1]).sum(), inputs)
    # the gaps' gates are zeros that ``PackedRows.split`` writes (their gradients go nowhere)
    for i, (a, b) in enumerate(zip(ours_grads, their_grads)):
        mask = real.view(2, width, *[1] * (a.dim() - 2)) if i < 5 else torch.ones(())
        assert rel_err(a * mask, b) < 1e-5


def test_rule_and_convolution_trace_whole_under_compile():
    """CUDA compiles each decoder block (``model.compile``): the rule's and the convolution's hand-written functions
    trace as one graph (``aot_eager``, ``fullgraph``), with eager's gradients."""
    from neva.models.packed_rows import causal_conv_last

    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 16, 1, 4, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 16, 2, 3, generator=gen, requires_grad=True)
    g, beta = -torch.rand(2, 16, 2, generator=gen), torch.rand(2, 16, 2, generator=gen)
    filters = torch.randn(3, 1, 4, generator=gen, requires_grad=True)
    resets = torch.tensor([[False, True], [False, False]])

    def loss(q, k, v, filters):
        out, state = chunked_delta_rule(q, k, v, g, beta, chunk=8, resets=resets)
        return (causal_conv_last(out.flatten(2), filters.repeat(2, 1, 1)) ** 2).sum() + state.sum()

    with one_thread():
        eager = torch.autograd.grad(loss(q, k, v, filters), (q, k, v, filters))
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        traced = torch.autograd.grad(compiled(q, k, v, filters), (q, k, v, filters))
    for a, b in zip(traced, eager):
        assert rel_err(a, b) < 1e-6
