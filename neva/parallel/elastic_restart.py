"""The process group of a group that ``torchrun --max-restarts`` restarted.

torchelastic keeps one key-value store for the whole job (its agent hosts it; ``TORCHELASTIC_USE_AGENT_STORE``), and
torch 2.13's env:// rendezvous uses it without a per-attempt prefix. A restarted group then reads the first attempt's
keys: the gloo/NCCL mesh of the default group or of a sub-group dials the dead ranks' addresses and fails
("connectFullMesh … Connection refused"), even for a plain torch program. Keys of attempt k live under their own prefix
here, so every attempt starts from an empty namespace. The first attempt keeps torch's own rendezvous.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def restart_count() -> int:
    """How many times torchelastic has restarted this group (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def init_restarted_group(backend: str, timeout: timedelta, device: torch.device) -> bool:
    """Initialise the default process group of a restarted torchelastic attempt on the agent's store, under the
    prefix ``neva/attempt_<k>``; returns False (and does nothing) on a first attempt, outside torchelastic, or when a
    group already exists, so the caller's usual rendezvous runs."""
    attempt = restart_count()
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"neva/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type != "cpu" else None,
    )
    return True
