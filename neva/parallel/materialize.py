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
from neva.training.build import ModelSource, materialize


def materialize_parts(model: NevaModel, source: ModelSource, device: torch.device, seed: int) -> NevaModel:
    """Materialise the whole ``model`` in place on ``device`` (same init and weights as one process)."""
    materialize(model, source, device, seed)
    return model


class _ShardSlot:
    """Where a full tensor read from disk goes: this rank's slice of one (possibly DTensor) parameter."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param

    @property
    def shape(self) -> torch.Size:
        return self.param.shape  # the global shape, for DTensors too

    def copy_(self, full: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        p = self.param
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank read the same full tensor, so each slices locally (no collective).
            local = distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
        else:
            p.copy_(full)


class _ShardedView:
    """Duck-typed model for the loaders (``cfg`` + ``state_dict()`` under plain neva keys) over sharded parts."""

    def __init__(self, parts: list[nn.Module]) -> None:
        from neva.checkpoint.dcp import named_parameters

        self.cfg = parts[0].cfg
        self._slots = {name.replace(".base.", "."): _ShardSlot(p) for name, p in named_parameters(parts)}

    def state_dict(self) -> dict[str, _ShardSlot]:
        return dict(self._slots)


@torch.no_grad()
def materialize_sharded(parts: list[nn.Module], source: ModelSource, device: torch.device, seed: int) -> None:
    """Allocate only this rank's shards of already-parallelized meta ``parts``, then fill them.

    Fresh parameters are initialised shard by shard (``init_weights`` on DTensors: statistically the same init,
    not bit-identical to one process); neva-checkpoint or HF weights are then read tensor by tensor and each rank
    copies in its own slice, so no rank ever holds more than its shards plus one full tensor.
    """
    from neva.checkpoint import neva_format

    for part in parts:
        requires = {n: p.requires_grad for n, p in part.named_parameters()}
        part.to_empty(device=device)
        part.tie_weights()
        torch.manual_seed(seed)
        part.init_weights()
        for n, p in part.named_parameters():
            p.requires_grad_(requires[n])
    view = _ShardedView(parts)
    if source.hf_llm is not None:
        from neva.checkpoint.hf import load_hf_weights

        load_hf_weights(view, llm_dir=source.hf_llm, vision_dir=source.hf_vision)
    elif source.checkpoint is not None:
        slots = view.state_dict()
        for key, full in neva_format.iter_tensors(source.checkpoint):
            slot = slots.get(key)
            if slot is not None:  # None: another pipeline stage owns it
                slot.copy_(full)
