"""The gated delta rule (Gated DeltaNet, Yang et al. 2024): chunked for prompts and training, one step for decoding.

Per value head, with the query / key of its key head L2-normalised and the query scaled by ``key_head_dim ** -0.5``,
a state ``S`` ``[dk, dv]`` evolves over the tokens as

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t,

``a_t = exp(g_t)`` the decay (``g <= 0``, log space) and ``b_t`` the write strength. Chunked form (all positions of
a chunk of C at once, the state passed from chunk to chunk): with ``G`` the cumulative ``g`` inside the chunk and
``S_0`` the state before it, the corrections ``E`` (what each token writes) solve the unit lower-triangular system

    (I + A) E = b V - b exp(G) K S_0,   A_ti = b_t exp(G_t - G_i) k_t^T k_i  (i < t),

written ``E = U - W S_0`` (``(I + A)^-1`` times both right-hand sides), and

    O = exp(G) Q S_0 + (Q K^T ∘ exp(G_t - G_i), i <= t) E,
    S_C = exp(G_C) S_0 + (K ∘ exp(G_C - G))^T E.

Padding a sequence with ``b = 0`` and ``g = 0`` leaves the state as it was (``neva.models.gated_deltanet`` pads
each packed sample so and reads its final state at the padded end). On CUDA, ``flash-linear-attention``'s kernel
(``fla.ops.gated_delta_rule``) computes the same when it is installed; neva's own code runs otherwise.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CHUNK = 32


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|² + eps)`` over the last dimension (the kernels' rule, eps inside the root)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


@functools.cache
def fla_kernel():
    """``flash-linear-attention``'s chunked gated delta rule, or None where it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _prepare(q, k, v, g, beta):
    """fp32 ``[B, H, S, d]`` queries / keys per value head (normalised, query scaled), values, ``[B, H, S]`` g, beta."""
    heads = v.shape[2]
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    if k.shape[2] != heads:  # each key head serves consecutive value heads
        q = q.repeat_interleave(heads // k.shape[2], dim=2)
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
    q = q * q.shape[-1] ** -0.5
    return [t.transpose(1, 2).float() for t in (q, k, v)] + [t.transpose(1, 2).float() for t in (g, beta)]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_kernel: bool = True,
    resets: torch.Tensor | None = None,
    fresh: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``[B, S, Hv, dv]`` (q's dtype) and the final state ``[B, Hv, dk, dv]`` (fp32).

    ``q``, ``k`` ``[B, S, Hk, dk]`` (not yet normalised), ``v`` ``[B, S, Hv, dv]``, ``g`` (log decay, <= 0) and
    ``beta`` ``[B, S, Hv]``; ``initial_state`` None = zeros. ``resets`` ``[B, S / CHUNK]``: chunks that start with a
    zero state (packed samples, each starting a chunk; ``S`` a multiple of ``CHUNK``); ``fresh``: every row's first
    chunk is one (known on the host: reading ``resets`` would sync). ``use_kernel``: take fla's kernel on CUDA where
    installed, from a zero state (packed rows as its variable-length sequences).
    """
    fresh = initial_state is None and (resets is None or fresh)
    kernel = fla_kernel() if use_kernel and q.is_cuda and fresh else None
    if kernel is None:
        return chunked_delta_rule(q, k, v, g, beta, initial_state, resets=resets)
    b, s, heads = v.shape[:3]
    if k.shape[2] != heads:
        q = q.repeat_interleave(heads // k.shape[2], dim=2)
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
    if resets is None:
        out, state = kernel(
            q, k, v, g=g.float(), beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )  # fmt: skip
        return out.to(q.dtype), state.float()
    # Every reset chunk starts a sequence of the flattened rows (each row's first chunk is one); a row's final state
    # is its last sequence's (the gap after it leaves the state alone).
    starts = resets.reshape(-1).nonzero().squeeze(1) * CHUNK
    bounds = torch.cat([starts, starts.new_tensor([b * s])])
    flat = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g.float(), beta)]
    out, states = kernel(
        *flat[:3], g=flat[3], beta=flat[4], output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds
    )  # fmt: skip
    last = resets.sum(dim=1).cumsum(0) - 1
    return out.view(b, s, heads, -1).to(q.dtype), states[last].float()


def chunked_delta_rule(q, k, v, g, beta, initial_state=None, chunk: int = CHUNK, resets=None):
    """neva's own chunked computation (module docstring); the arguments of ``gated_delta_rule``."""
    dtype, (b, s, key_heads, dk) = q.dtype, q.shape
    heads, dv = v.shape[2:]
    group = heads // key_heads  # the value heads each key head serves (consecutive)
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * dk**-0.5
    # Key heads stay key heads: [B, Hk, 1, S, d] against the value heads' [B, Hk, group, S, ...], so the products
    # of queries and keys run once per key head and the rest broadcasts (no copy of q and k per value head).
    q, k = (t.transpose(1, 2)[:, :, None] for t in (q, k))
    v = v.float().transpose(1, 2).unflatten(1, (key_heads, group))
    g, beta = (t.float().transpose(1, 2).unflatten(1, (key_heads, group)) for t in (g, beta))
    pad = -s % chunk
    if pad:  # b = g = 0 on the padding: the state passes through it unchanged
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (s + pad) // chunk
    q, k, v = (t.unflatten(3, (n, chunk)) for t in (q, k, v))  # [B, Hk, 1 or group, n, C, d]
    g, beta = g.unflatten(3, (n, chunk)), beta.unflatten(3, (n, chunk))
    cum = g.cumsum(-1)  # G
    # exp(G_t - G_i) for i <= t, else 0: zeros before exp (no overflow above the diagonal) and after it; twice
    # the speed of masking with -inf, whose exp takes a slow path
    decay = (cum[..., :, None] - cum[..., None, :]).tril().exp().tril()
    # A (its diagonal is ignored: unit triangular)
    system = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    # (I + A)^-1 first, then products: on CPU the solve's time grows with its right-hand side's width and the
    # products' far less (forward and backward about half of solving for both right-hand sides directly)
    inverse = _UnitLowerInverse.apply(system)
    u = inverse @ (v * beta[..., None])
    w = inverse @ (k * (beta * cum.exp())[..., None])
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    u, w, scores, q_decayed, k_to_end, chunk_decay = (
        t.flatten(1, 2) for t in (u, w, scores, q_decayed, k_to_end, chunk_decay)
    )  # [B, Hv, n, ...]
    initial = q.new_zeros(b, heads, dk, dv) if initial_state is None else initial_state.float()
    # Only the state's recurrence runs chunk by chunk (``_StateChain``); the outputs, which read each chunk's
    # starting state and corrections, follow for all chunks at once.
    starts, corrections, state = _StateChain.apply(
        u, w, k_to_end.transpose(-1, -2), chunk_decay, initial, None if resets is None else ~resets
    )  # fmt: skip
    outs = q_decayed @ starts + scores @ corrections
    out = outs.reshape(b, heads, n * chunk, dv)[:, :, :s]
    return out.transpose(1, 2).to(dtype), state


class _UnitLowerInverse(torch.autograd.Function):
    """``(I + tril(A, -1))^-1`` of ``[..., C, C]`` (``A``'s diagonal and upper part ignored). Backward from the
    inverse ``X``: ``-tril(X^T G X^T, -1)``, two products where autograd's solves a triangular system again (less
    than half its time on the CPU benchmark's chunks)."""

    @staticmethod
    def forward(ctx, system: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(system.shape[-1], dtype=system.dtype, device=system.device).expand_as(system)
        inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
        ctx.save_for_backward(inverse)
        return inverse

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (inverse,) = ctx.saved_tensors
        transposed = inverse.transpose(-1, -2)
        return (transposed @ grad @ transposed).neg_().tril_(-1)


class _StateChain(torch.autograd.Function):
    """The chunks' starting states ``S_i`` ``[B, H, n, dk, dv]``, corrections ``E_i = U_i - W_i S_i`` ``[B, H, n, C,
    dv]`` and the final state, chunk by chunk: ``S_{i+1} = d_i S_i + K_i E_i`` (``d`` ``[B, H, n, 1, 1]`` the
    chunk's decay, ``K`` ``[B, H, n, dk, C]`` its keys decayed to its end), from ``initial`` ``[B, H, dk, dv]``;
    where ``keep`` ``[B, n]`` (None: everywhere) is False the state entering the chunk is zero (packed samples).

    Backward by hand: the chain in reverse, all products of a chunk while its matrices are in cache (autograd's
    would record and replay each chunk's several small operations, and stack their gradients per input). Rows and
    heads are one batch dimension of the chunk's products (``[B·H, n, ...]`` views, a chunk's slice strided)."""

    @staticmethod
    def forward(ctx, u, w, k_to_end, decays, initial, keep):
        b, heads, n = u.shape[:3]
        u_, w_, k_, d_ = (t.flatten(0, 1) for t in (u, w, k_to_end, decays))
        kept = None if keep is None else keep.to(u.dtype).repeat_interleave(heads, 0)[..., None, None]
        state = initial.flatten(0, 1)
        starts, corrections = [], []
        for i in range(n):
            if kept is not None:
                state = state * kept[:, i]
            written = torch.baddbmm(u_[:, i], w_[:, i], state, alpha=-1)
            starts.append(state)
            corrections.append(written)
            state = torch.baddbmm(state * d_[:, i], k_[:, i], written)
        starts, corrections = torch.stack(starts, 1), torch.stack(corrections, 1)
        ctx.save_for_backward(w_, k_, d_, kept, starts, corrections)
        ctx.rows = (b, heads)
        return starts.unflatten(0, ctx.rows), corrections.unflatten(0, ctx.rows), state.view_as(initial)

    @staticmethod
    def backward(ctx, d_starts, d_corrections, d_final):
        w_, k_, d_, kept, starts, corrections = ctx.saved_tensors
        n = starts.shape[1]
        d_starts = torch.zeros_like(starts) if d_starts is None else d_starts.flatten(0, 1)
        d_corrections = torch.zeros_like(corrections) if d_corrections is None else d_corrections.flatten(0, 1)
        # d_state: the gradient of the state after chunk i (before chunk i + 1's reset)
        d_state = torch.zeros_like(starts[:, 0]) if d_final is None else d_final.flatten(0, 1)
        d_u, d_w, d_k, d_d = ([None] * n for _ in range(4))
        for i in range(n - 1, -1, -1):  # lists stacked once (no out= into views: torch.compile traces this)
            start, written = starts[:, i], corrections[:, i]
            d_k[i] = torch.bmm(d_state, written.transpose(-1, -2))
            d_d[i] = (d_state * start).sum((-1, -2), keepdim=True)
            d_written = d_u[i] = torch.baddbmm(d_corrections[:, i], k_[:, i].transpose(-1, -2), d_state)
            d_w[i] = torch.bmm(d_written, start.transpose(-1, -2)).neg_()
            d_state = torch.baddbmm(
                torch.addcmul(d_starts[:, i], d_[:, i], d_state), w_[:, i].transpose(-1, -2), d_written, alpha=-1
            )
            if kept is not None:
                d_state = d_state * kept[:, i]
        d_u, d_w, d_k, d_d = (torch.stack(t, 1) for t in (d_u, d_w, d_k, d_d))
        rows = ctx.rows
        return (
            d_u.unflatten(0, rows), d_w.unflatten(0, rows), d_k.unflatten(0, rows), d_d.unflatten(0, rows),
            d_state.unflatten(0, rows), None,
        )  # fmt: skip


def delta_rule_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token from ``state`` (decoding: usually one token); the arguments of ``gated_delta_rule``."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = state.float()
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = (k[:, :, t, :, None] * state).sum(-2)  # S^T k
        written = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * written[:, :, None, :]
        outs.append((q[:, :, t, :, None] * state).sum(-2))
    return torch.stack(outs, dim=1).to(dtype), state
