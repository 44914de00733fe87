"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), independent of the layout.

Keys are the plain model names (``llm.layers.3.attention.wq.weight``) whatever wraps the parameters (FSDP2, DTensor
TP shards, pipeline stages, activation checkpointing, compile), and optimizer state is stored per parameter under
``<name>.<state>`` (``exp_avg``, ``exp_avg_sq``, ``step``). DCP records each tensor's global shape and the piece
every rank wrote, so a checkpoint saved under one layout loads into any other: each rank reads the pieces its own
shards need.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

Named = list[tuple[str, torch.Tensor]]  # (plain name, the tensor a checkpoint stores for that parameter)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zeros, sharded like each parameter) so a load has tensors to fill in place."""
    for group in optimizer.param_groups:
        # Where torch's AdamW keeps ``step``: on the parameter's device for the fused (CUDA) and capturable kernels.
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(p.data, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p.data, memory_format=torch.preserve_format),
            }


def optimizer_state(named: Named, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state under ``<plain parameter name>.<key>``."""
    out = {}
    for name, p in named:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value
    return out


def save(path: str | Path, named: Named, optimizer: torch.optim.Optimizer | None) -> None:
    """Write this rank's parameters ``named`` (sharded as they are) and their optimizer state into directory
    ``path`` (a collective)."""
    state = {"model": {name: p.data for name, p in named}}
    if optimizer is not None:
        state["optim"] = optimizer_state(named, optimizer)
    dcp.save(state, checkpoint_id=str(path))


def load(path: str | Path, named: Named, optimizer: torch.optim.Optimizer | None) -> None:
    """Fill ``named`` and their optimizer state in place from directory ``path``, whatever layout wrote it (a
    collective; DCP casts to each tensor's dtype)."""
    state = {"model": {name: p.data for name, p in named}}
    if optimizer is not None:
        init_optimizer_state(optimizer)
        state["optim"] = optimizer_state(named, optimizer)
    dcp.load(state, checkpoint_id=str(path))
