"""Per-token side inputs of one decoder forward, handed to the layers deep inside a block that need them.

LoRA adapters key their dropout masks by token (``dropout_keys``); MoE routers count only real tokens in their
load-balancing statistics (``token_mask``). ``LlamaDecoder.forward`` sets both for the blocks it runs; blocks,
attention and feed-forward code pass nothing on and know nothing of adapters or routers.

A module global, not a ``ContextVar``: dynamo traces a read of a global into a compiled block's graph (guarding on
the tensors it holds), where ``ContextVar.get`` breaks the graph. A process runs its forwards on one thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def at_rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` ``[B, S, ...]`` at ``rows`` ``[N, 2]`` (row, column) as ``[N, ...]``; ``t`` itself without rows."""
    return t if t is None or rows is None else t[rows[:, 0], rows[:, 1]]


@dataclass(frozen=True)
class TokenInputs:
    """``dropout_keys`` ``[B, S]``: LoRA dropout keys (``neva.models.lora.token_dropout_keys``; None: the RNG
    stream's dropout). ``token_mask`` ``[B, S]``: True where a token counts in MoE routers' load-balancing statistics
    (None: every token). Both of the activations' leading dims."""

    dropout_keys: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None

    def at(self, rows: torch.Tensor | None) -> TokenInputs:
        """These inputs for activations narrowed to ``rows`` (``at_rows``)."""
        return TokenInputs(at_rows(self.dropout_keys, rows), at_rows(self.token_mask, rows))


class _Current:
    inputs = TokenInputs()


_CURRENT = _Current()


def current_token_inputs() -> TokenInputs:
    return _CURRENT.inputs


@contextlib.contextmanager
def token_inputs(inputs: TokenInputs) -> Iterator[None]:
    """Layers inside this context see ``inputs``; the previous ones come back after."""
    previous = _CURRENT.inputs
    _CURRENT.inputs = inputs
    try:
        yield
    finally:
        _CURRENT.inputs = previous


@contextlib.contextmanager
def token_inputs_at(rows: torch.Tensor | None) -> Iterator[None]:
    """Inside, layers see the current inputs at ``rows`` only (``TokenInputs.at``; unchanged without rows)."""
    with token_inputs(_CURRENT.inputs.at(rows)):
        yield
