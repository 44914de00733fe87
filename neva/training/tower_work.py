"""A native-resolution tower's work per data-parallel rank in a step, for ``metrics.csv``: the most and the mean
tower patches a rank ran (their ratio is how long the step waits on its slowest tower; the sampler balances them,
``neva.data.patch_balance``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from neva.data.micro_batch import MicroBatch


def micro_batch_patches(mb: MicroBatch) -> int:
    """Tower patches of a collated micro-batch: t·h·w of every image and video item of a native tower's grids."""
    media = mb.media
    if media is None:
        return 0
    total = 0
    for modality in ("image", "video"):
        inputs = getattr(media, modality, None)
        if inputs is not None and inputs.grid is not None:
            total += int(inputs.grid.prod(-1).sum())
    return total


def tower_patch_metrics(micro_batches: list[MicroBatch], dp_group: Any, device: torch.device) -> dict[str, float]:
    """``tower_patches_max`` / ``tower_patches_mean`` over the data-parallel ranks of this step's micro-batches (one
    all-reduce of a vector with one slot per rank; every rank of the group must call it)."""
    mine = float(sum(micro_batch_patches(mb) for mb in micro_batches))
    if dp_group is None:
        per_rank = torch.tensor([mine])
    else:
        per_rank = torch.zeros(dist.get_world_size(dp_group), device=device, dtype=torch.float64)
        per_rank[dist.get_rank(dp_group)] = mine
        dist.all_reduce(per_rank, group=dp_group)
    return {"tower_patches_max": per_rank.max().item(), "tower_patches_mean": per_rank.mean().item()}
