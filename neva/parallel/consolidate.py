"""The whole model's tensors gathered from this rank's parts, one at a time: what the end-of-stage export writes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from neva.checkpoint.names import canonical_name, lora_layers
from neva.models.lora import merged_key, plain_key
from neva.parallel.parallelize import ParallelModel


def _local_getters(model: ParallelModel) -> dict[str, Callable[[], torch.Tensor]]:
    """Plain export key → function returning its full fp32 tensor (a collective over this stage's dp × tp ranks for
    sharded ones); trained weights come from the fp32 master copies under O2, LoRA layers are merged."""
    masters = {}
    if model.master is not None:
        masters = {id(p): m for p, (_, m) in zip(model.master.model_params, model.master.named_master)}

    def full(p: torch.Tensor) -> torch.Tensor:
        t = masters.get(id(p), p).data
        return (t.full_tensor() if isinstance(t, DTensor) else t).float()

    out: dict[str, Callable[[], torch.Tensor]] = {}
    for part in model.parts:
        lora = lora_layers([part])
        # Tied weights appear under each of their names (the export writes both, as the state dict does).
        for wrapped, p in part.named_parameters(remove_duplicate=False):
            key = plain_key(canonical_name(wrapped), lora)
            if key is not None:
                out[key] = lambda p=p: full(p)
        for owner, m in lora.items():
            out[merged_key(owner)] = lambda m=m: m.merged_weight(full)
    return out


def consolidated_tensors(model: ParallelModel) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(plain key, full fp32 CPU tensor)`` of the whole model on global rank 0 (None elsewhere), in state-dict order.

    Every rank must iterate along: gathers are collectives, and other pipeline stages send their tensors to rank 0.
    """
    local = _local_getters(model)
    rank = dist.get_rank() if model.dims is not None else 0
    my_stage = model.dims.pp_rank if model.dims is not None else 0
    stage_size = model.layout.dp * model.layout.tp
    device = next(p.device for p in model.parts[0].parameters())
    for key, shape in model.export_keys.items():
        stage = model.key_stage[key]
        tensor = local[key]().detach() if stage == my_stage else None
        if stage != 0:
            sender = stage * stage_size
            if rank == sender:
                dist.send(tensor.contiguous().to(device), dst=0)
            elif rank == 0:
                tensor = torch.empty(shape, dtype=torch.float32, device=device)
                dist.recv(tensor, src=sender)
        yield key, tensor.cpu() if rank == 0 else None
