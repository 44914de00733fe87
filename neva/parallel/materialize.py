"""Giving the meta model its weights on every rank.

Small models (the default, and every CPU test) are materialised whole on each rank with the run's seed, exactly as
one process would, and then cut and sharded: every layout starts from bit-identical weights. Models too large for
that (``model.meta_init=true``) go through ``materialize_sharded`` after parallelization (see
``docs/DISTRIBUTED.md``).
"""

from __future__ import annotations

import torch
from torch import nn

from neva.models.neva import NevaModel
from neva.training.build import ModelSource, init_fresh, load_source_weights, materialize


def materialize_parts(model: NevaModel, source: ModelSource, device: torch.device, seed: int) -> NevaModel:
    """Materialise the whole ``model`` in place on ``device`` (same init and weights as one process)."""
    materialize(model, source, device, seed)
    return model


@torch.no_grad()
def materialize_sharded(parts: list[nn.Module], source: ModelSource, device: torch.device, seed: int) -> None:
    """Allocate only this rank's shards of already-parallelized meta ``parts``, then fill them.

    Fresh parameters are initialised shard by shard (``init_weights`` on DTensors: statistically the same init,
    not bit-identical to one process); neva-checkpoint or HF weights are then read tensor by tensor and each rank
    copies in its own slice, so no rank ever holds more than its shards plus one full tensor.
    """
    for part in parts:
        init_fresh(part, device, seed)
    load_source_weights(parts, source)
