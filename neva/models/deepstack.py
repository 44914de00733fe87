"""Qwen3-VL's DeepStack: visual features of intermediate tower blocks added to the decoder's residual stream.

HF ``Qwen3VLTextModel`` adds the i-th DeepStack merger's output to the hidden states at the visual positions right
after decoder layer i (i < the number of DeepStack mergers). Here that is one structure for the decoder: per layer
name, a dense ``[B, S, D]`` tensor (zero outside the visual positions) that ``DecoderBlock`` adds to its output.
Dense rather than (positions, values) so it takes the residual stream's layout wherever the stream goes: under
sequence parallelism the plan shards it over the sequence as it shards the stream (neva/parallel/tensor_parallel.py);
a pipeline keeps these layers on the first stage, beside the embedding that makes them (neva/parallel/pipeline.py).
"""

from __future__ import annotations

import torch


def layer_additions(
    h_BSD: torch.Tensor, placed: list[tuple[torch.Tensor, list[torch.Tensor]]], layers: int
) -> dict[str, torch.Tensor] | None:
    """``{str(i): [B, S, D]}``: for each DeepStack layer ``i < layers`` (``NevaConfig.deepstack_layers``), every
    modality's i-th features ``[M, D]`` written at its ``[M, 2]`` (row, column) positions (``placed``: one
    (positions, features per layer) per modality), zeros elsewhere; None when no modality carries DeepStack features
    (the decoder then runs exactly as without them)."""
    if not placed or not layers:
        return None
    out = {}
    for i in range(layers):
        add = torch.zeros_like(h_BSD)
        for positions, feats in placed:
            positions = positions.to(h_BSD.device)
            add = add.index_put((positions[:, 0], positions[:, 1]), feats[i].to(h_BSD.dtype), accumulate=True)
        out[str(i)] = add
    return out
