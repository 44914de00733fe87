"""The planner's terms of a hybrid decoder's linear-attention layers (Qwen3.5's Gated DeltaNet,
``neva.models.gated_deltanet``): what one layer keeps for backward and what it exchanges under context parallelism.

Activations per token, a layer's tensor-parallel share (``1 / tp`` of the heads): the projections' outputs in the
compute dtype (q, k, v, the convolution's ``K − 1`` shifted inputs and its output, z, the gated norm's input and
output: ``(K + 1)·conv_dim + 3·value_dim`` elements), and the delta rule's fp32 tensors per value head
(``neva.models.delta_rule``, chunks of ``C``): the query and key before and after normalisation, their copies per
value head, ``beta·k``, the decayed query and key and the key-side correction ``W`` (``11·dk``), ``beta·v``, the
corrections ``U``, the right-hand sides and the output (``4·dv``), the decay (and its mask), the triangular system
and the scores rows (``4·C``) and the state at each chunk start (``dk·dv / C``). Calibrated against the rehearsal
(``neva.plan plan.rehearse=true`` of ``model=tiny_qwen3_5`` behind the tiny CLIP tower: the planned activations
within 10 % of the measured, fp32). Under context parallelism the rule runs a second time from the identity (``dk``
values: ``Q`` and the transition), and every chunk's end state and transition are gathered: ``2·cp`` chunks of
``Hv·dk·(dv + dk)`` fp32 numbers per row, in place of the attention layers' keys and values.
"""

from __future__ import annotations

from neva.models.config import LLMConfig
from neva.models.delta_rule import CHUNK


def linear_layer_bytes(llm: LLMConfig, tokens: float, compute_bytes: int, tp: int, cp: int) -> float:
    """Bytes one linear-attention layer's mixer keeps for backward for ``tokens`` tokens on a rank."""
    la = llm.linear_attention
    dk, dv, heads = la.key_head_dim, la.value_head_dim, la.num_value_heads / tp
    projections = compute_bytes * tokens * ((la.conv_kernel_dim + 1) * la.conv_dim + 3 * la.value_dim) / tp
    per_head = 11 * dk + 4 * dv + 4 * CHUNK + dk * dv / CHUNK
    rule = 4 * tokens * heads * per_head
    if cp > 1:  # the second run from the identity: dk values instead of dv
        rule += 4 * tokens * heads * (11 * dk + 4 * dk + 4 * CHUNK + dk * dk / CHUNK)
    return projections + rule


def state_exchange_bytes(llm: LLMConfig, rows: int, tp: int, cp: int) -> float:
    """Bytes of one linear-attention layer's state gather under context parallelism (all ranks' chunks)."""
    la = llm.linear_attention
    return 4 * rows * 2 * cp * la.num_value_heads / tp * la.key_head_dim * (la.value_head_dim + la.key_head_dim)
