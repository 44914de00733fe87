"""Qwen3.5's fused linear-attention tensors ↔ neva's q / k / v parts.

transformers keeps a Gated DeltaNet layer's input projection of q, k and v in one ``linear_attn.in_proj_qkv.weight``
``[2·key_dim + value_dim, H]`` and their depthwise filters in one ``linear_attn.conv1d.weight`` ``[2·key_dim +
value_dim, 1, K]``; neva holds each part on its own (``in_proj_q/k/v``, ``conv_q/k/v``: tensor parallelism shards
each by heads; a fused tensor's rows would fall across the parts). Reading splits the fused HF keys into the parts'
(``linear_attn.in_proj_q.weight``, ``linear_attn.conv_q.weight``, ...) before the key table (``hf_keys``) sees them;
writing joins them back, in q, k, v order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from neva.models.hybrid_config import LinearAttentionConfig

_FUSED = re.compile(r"^(.*\.linear_attn\.)(in_proj_qkv|conv1d)\.weight$")
_PART = re.compile(r"^(.*\.linear_attn\.)(in_proj|conv)_([qkv])\.weight$")
_PARTS = {"in_proj_qkv": "in_proj", "conv1d": "conv"}
_FUSED_OF = {v: k for k, v in _PARTS.items()}


def _sizes(la: LinearAttentionConfig) -> list[int]:
    return [la.key_dim, la.key_dim, la.value_dim]


def split_shapes(shapes: dict[str, tuple[int, ...]], la: LinearAttentionConfig | None) -> dict[str, tuple[int, ...]]:
    """HF key → shape with each fused tensor's shape as its three parts'."""
    if la is None:
        return shapes
    out = {}
    for key, shape in shapes.items():
        match = _FUSED.match(key)
        if match is None:
            out[key] = shape
            continue
        for part, rows in zip("qkv", _sizes(la)):
            out[f"{match.group(1)}{_PARTS[match.group(2)]}_{part}.weight"] = (rows, *shape[1:])
    return out


def split_tensors(
    pairs: Iterable[tuple[str, torch.Tensor]], la: LinearAttentionConfig | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``pairs`` with each fused tensor as its three parts.

    Raises:
        ValueError: a fused tensor whose rows are not ``2·key_dim + value_dim`` of the config.
    """
    for key, tensor in pairs:
        match = _FUSED.match(key) if la is not None else None
        if match is None:
            yield key, tensor
            continue
        if tensor.shape[0] != sum(_sizes(la)):
            raise ValueError(f"{key}: {tensor.shape[0]} rows, the config's q, k, v need {sum(_sizes(la))}")
        for part, piece in zip("qkv", tensor.split(_sizes(la))):
            yield f"{match.group(1)}{_PARTS[match.group(2)]}_{part}.weight", piece


def fuse_tensors(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Stream ``pairs`` (HF keys with the parts split) with each layer's q, k, v parts joined into the fused tensor
    (a part waits for its two siblings)."""
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in pairs:
        match = _PART.match(key)
        if match is None:
            yield key, tensor
            continue
        group = pending.setdefault((match.group(1), match.group(2)), {})
        group[match.group(3)] = tensor
        if len(group) == 3:
            prefix, kind = match.group(1), match.group(2)
            yield f"{prefix}{_FUSED_OF[kind]}.weight", torch.cat([group[p] for p in "qkv"])
            del pending[(prefix, kind)]
    if pending:
        raise ValueError(f"linear-attention parts without all of q, k, v: {sorted(pending)}")
