"""Mixtral's expert tensors between HF checkpoint layouts and neva's one tensor per projection and layer.

HF stores Mixtral's experts in two layouts: per expert (``block_sparse_moe.experts.{e}.w1.weight`` ``[I, H]``, w2,
w3; the hub checkpoints, transformers 4.x, and what transformers 5 still reads through its conversion mapping) and
stacked (transformers 5 models: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, gate rows first, and
``mlp.experts.down_proj`` ``[E, H, I]``; the router ``mlp.gate.weight``). Reading normalises both, before the key
tables see them, to one canonical stacked form (``block_sparse_moe.experts.w1`` ``[E, I, H]``, ``w3``, ``w2``
``[E, H, I]``, ``block_sparse_moe.gate.weight``), which ``hf_keys.LLM_TABLE`` maps 1:1 to neva; writing unstacks the
canonical form into the per-expert layout. Non-MoE keys pass through untouched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_PER_EXPERT = re.compile(r"^(.*\.)block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
# Qwen-MoE's per-expert layout (what transformers 5 writes for Qwen3.5-MoE): ``mlp.experts.{e}.gate_proj.weight``...
_PER_EXPERT_QWEN = re.compile(r"^(.*\.)mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QWEN_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_STACKED_GATE_UP = re.compile(r"^(.*\.)mlp\.experts\.gate_up_proj$")
_STACKED_DOWN = re.compile(r"^(.*\.)mlp\.experts\.down_proj$")
_STACKED_ROUTER = re.compile(r"^(.*\.)mlp\.gate\.weight$")
_CANONICAL = re.compile(r"^(.*\.)block_sparse_moe\.experts\.(w[123])$")


def _canonical(prefix: str, name: str) -> str:
    return f"{prefix}block_sparse_moe.experts.{name}"


def expert_groups(keys: Iterable[str]) -> dict[str, list[str]]:
    """Canonical stacked key → the per-expert HF keys it stacks, in expert order (per-expert layout only).

    Raises:
        ValueError: a layer's experts are not numbered 0..E-1.
    """
    groups: dict[str, dict[int, str]] = {}
    for key in keys:
        match = _PER_EXPERT.match(key)
        if match:
            groups.setdefault(_canonical(match.group(1), match.group(3)), {})[int(match.group(2))] = key
        match = _PER_EXPERT_QWEN.match(key)
        if match:
            name = _QWEN_NAMES[match.group(3)]
            groups.setdefault(_canonical(match.group(1), name), {})[int(match.group(2))] = key
    out = {}
    for canonical, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{canonical}: experts {sorted(by_expert)} are not numbered 0..{len(by_expert) - 1}")
        out[canonical] = [by_expert[e] for e in range(len(by_expert))]
    return out


def canonical_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` (HF key → shape) with Mixtral experts in the canonical stacked form."""
    groups = expert_groups(shapes)
    stacked = {key for members in groups.values() for key in members}
    out = {k: v for k, v in shapes.items() if k not in stacked}
    for canonical, members in groups.items():
        out[canonical] = (len(members), *shapes[members[0]])
    for key in list(out):
        split = _split_stacked(key, out[key])
        if split:
            del out[key]
            out.update(split)
    return out


def _split_stacked(key: str, value: Any) -> list[tuple[str, Any]]:
    """A transformers-5 stacked key (tensor or shape) as canonical pairs; [] for any other key."""
    match = _STACKED_GATE_UP.match(key)
    if match:
        prefix = match.group(1)
        if isinstance(value, torch.Tensor):
            w1, w3 = value.chunk(2, dim=1)
        else:
            w1 = w3 = (value[0], value[1] // 2, *value[2:])
        return [(_canonical(prefix, "w1"), w1), (_canonical(prefix, "w3"), w3)]
    match = _STACKED_DOWN.match(key)
    if match:
        return [(_canonical(match.group(1), "w2"), value)]
    match = _STACKED_ROUTER.match(key)
    if match:
        return [(f"{match.group(1)}block_sparse_moe.gate.weight", value)]
    return []


def canonical_tensors(
    pairs: Iterable[tuple[str, torch.Tensor]], groups: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``pairs`` with Mixtral experts in the canonical stacked form; ``groups`` from ``expert_groups``.

    Per-expert tensors are held until their layer's last expert arrives (a checkpoint keeps a layer's experts
    together, so at most about one layer's experts wait).
    """
    member_of = {key: canonical for canonical, members in groups.items() for key in members}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in pairs:
        canonical = member_of.get(key)
        if canonical is not None:
            parts = pending.setdefault(canonical, {})
            parts[key] = tensor
            if len(parts) == len(groups[canonical]):
                yield canonical, torch.stack([parts[k] for k in groups[canonical]])
                del pending[canonical]
            continue
        yield from _split_stacked(key, tensor) or [(key, tensor)]


def per_expert_tensors(key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """An HF key in canonical stacked form as the per-expert layout's keys (export); other keys as they are."""
    match = _CANONICAL.match(key)
    if match is None:
        yield key, tensor
        return
    for e in range(tensor.shape[0]):
        yield f"{match.group(1)}block_sparse_moe.experts.{e}.{match.group(2)}.weight", tensor[e]


def stacked_tensors(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``pairs`` (HF keys, experts in the canonical stacked form) in transformers 5's stacked layout (export of
    a family whose HF class has no per-expert layout: Qwen3-VL-MoE): ``w1`` waits for its layer's ``w3`` (or the
    reverse) to become ``gate_up_proj``; everything else as ``module_state`` names it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in pairs:
        match = _CANONICAL.match(key)
        if match is None or match.group(2) == "w2":
            yield from module_state({key: tensor}).items()
            continue
        parts = pending.setdefault(match.group(1), {})
        parts[match.group(2)] = tensor
        if len(parts) == 2:
            yield f"{match.group(1)}mlp.experts.gate_up_proj", torch.cat([parts["w1"], parts["w3"]], dim=1)
            del pending[match.group(1)]
    if pending:
        raise ValueError(f"experts without both w1 and w3: {sorted(pending)}")


def module_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (HF keys, experts in the canonical stacked form) as a transformers 5 Mixtral module holds it
    (``mlp.experts.gate_up_proj`` = w1 rows then w3 rows, ``mlp.experts.down_proj``, ``mlp.gate.weight``): what
    ``load_state_dict`` of a model built in memory takes (``from_pretrained`` converts by itself)."""
    out = {}
    for key, tensor in state.items():
        match = _CANONICAL.match(key)
        if match is None:
            router = key.endswith("block_sparse_moe.gate.weight")
            out[key.replace("block_sparse_moe.gate.", "mlp.gate.") if router else key] = tensor
        elif match.group(2) == "w2":
            out[f"{match.group(1)}mlp.experts.down_proj"] = tensor
        elif match.group(2) == "w1":
            w3 = state[f"{match.group(1)}block_sparse_moe.experts.w3"]
            out[f"{match.group(1)}mlp.experts.gate_up_proj"] = torch.cat([tensor, w3], dim=1)
    return out
