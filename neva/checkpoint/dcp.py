"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), independent of the layout.

Keys are the plain model names (``llm.layers.3.attention.wq.weight``) whatever wraps the parameters (FSDP2, DTensor
TP shards, pipeline stages, activation checkpointing, compile), and optimizer state is stored per parameter under
``<name>.<state>`` (``exp_avg``, ``exp_avg_sq``, ``step``). DCP records each tensor's global shape and the piece
every rank wrote, so a checkpoint saved under one layout loads into any other: each rank reads the pieces its own
shards need.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from neva.checkpoint.names import named_parameters


def model_state(parts: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters (sharded as they are) under plain names; DCP loads into these tensors in place."""
    return {name: p.data for name, p in named_parameters(parts)}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zeros, sharded like each parameter) so a load has tensors to fill in place."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p.data, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p.data, memory_format=torch.preserve_format),
            }


def optimizer_state(parts: Iterable[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state under ``<plain parameter name>.<key>``."""
    out = {}
    for name, p in named_parameters(parts):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value
    return out


def save(path: str | Path, parts: list[nn.Module], optimizer: torch.optim.Optimizer | None) -> None:
    """Write model (and optimizer) shards of every rank into directory ``path`` (a collective)."""
    state = {"model": model_state(parts)}
    if optimizer is not None:
        state["optim"] = optimizer_state(parts, optimizer)
    dcp.save(state, checkpoint_id=str(path))


def load(path: str | Path, parts: list[nn.Module], optimizer: torch.optim.Optimizer | None) -> None:
    """Fill this rank's shards from directory ``path``, whatever layout wrote it (a collective)."""
    state = {"model": model_state(parts)}
    if optimizer is not None:
        init_optimizer_state(optimizer)
        state["optim"] = optimizer_state(parts, optimizer)
    dcp.load(state, checkpoint_id=str(path))
