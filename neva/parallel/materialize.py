"""Giving the meta model its weights on every rank.

Small models (the default, and every CPU test) are materialised whole on each rank with the run's seed, exactly as
one process would, and then cut and sharded: every layout starts from bit-identical weights. Models too large for
that go through ``materialize_sharded`` after parallelization (see ``docs/DISTRIBUTED.md``).
"""

from __future__ import annotations

import torch
from torch import nn

from neva.models.neva import NevaModel
from neva.training.build import ModelSource, materialize


def materialize_parts(model: NevaModel, source: ModelSource, device: torch.device, seed: int) -> NevaModel:
    """Materialise the whole ``model`` in place on ``device`` (same init and weights as one process)."""
    materialize(model, source, device, seed)
    return model


@torch.no_grad()
def materialize_sharded(parts: list[nn.Module], source: ModelSource, device: torch.device, seed: int) -> None:
    """Allocate only this rank's shards of already-parallelized meta ``parts``, then fill them.

    Fresh parameters are initialised shard by shard (``init_weights`` on DTensors: statistically the same init,
    not bit-identical to one process); checkpoint / HF weights are then read tensor by tensor and each rank copies
    in its own slice (``distribute_tensor`` semantics), so no rank ever holds the whole model.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    from neva.checkpoint import neva_format
    from neva.checkpoint.dcp import named_parameters

    for part in parts:
        requires = {n: p.requires_grad for n, p in part.named_parameters()}
        part.to_empty(device=device)
        torch.manual_seed(seed)
        part.init_weights()
        for n, p in part.named_parameters():
            p.requires_grad_(requires[n])
    if source.hf_llm is not None:
        raise NotImplementedError("sharded loading of HF weights: convert with `python -m neva.convert` first")
    if source.checkpoint is None:
        return
    targets = dict(named_parameters(parts))
    for key, full in neva_format.iter_tensors(source.checkpoint):
        target = targets.get(key) or targets.get(key.replace(".weight", ".base.weight"))
        if target is None:
            continue  # another pipeline stage owns it
        if isinstance(target, DTensor):
            shard = distribute_tensor(full.to(device, target.dtype), target.device_mesh, target.placements)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)
