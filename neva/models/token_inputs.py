"""Per-token side inputs of one decoder forward, handed as an argument to the layers deep inside a block that read them.

LoRA adapters key their dropout masks by token (``dropout_keys``); MoE routers count only real tokens in their
load-balancing statistics (``token_mask``). ``LlamaDecoder.forward`` builds one ``TokenInputs`` and passes it to each
block (``token_inputs=``); a block hands it, narrowed to the positions it computes (``TokenInputs.at``), to its token
mixer and feed-forward, and those to their projections through ``project``, which hands it on only to a layer that
reads it (``reads_token_inputs``: LoRA's adapters). Blocks, attention and feed-forward know nothing of adapters or
routers; they carry an opaque argument.

An argument, not per-forward state: activation recomputation (``torch.utils.checkpoint``) replays it with the block's
other inputs, and a compiled block sees its tensors as graph inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


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


# A forward without per-token inputs (a layer run alone, a test): every layer's default.
NO_TOKEN_INPUTS = TokenInputs()


def project(layer: nn.Module, x: torch.Tensor, inputs: TokenInputs) -> torch.Tensor:
    """``layer(x)``, with ``inputs`` handed on (as ``token_inputs=``) where the layer reads them
    (``reads_token_inputs``); a plain ``nn.Linear`` (and any hook a parallel plan put on it) sees the call it always
    did."""
    if getattr(layer, "reads_token_inputs", False):
        return layer(x, token_inputs=inputs)
    return layer(x)
