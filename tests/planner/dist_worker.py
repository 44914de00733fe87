"""Worker of the 2-process gloo memory test: shard the tiny model three ways and report real local bytes.

``neva/parallel`` (#5) had no parallelize entry point yet, so the layouts are applied here directly with the same
rules the planner assumes: ``parallelize_module`` (Colwise wq/wk/wv/w1/w3, the LM head and projector.0, Rowwise wo/w2, the
embedding and projector.2) for TP, ``fully_shard`` per decoder layer / vision tower / projector / root for FSDP2, DDP for DDP.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from tests.planner.helpers import batch, measured_bytes, tiny_model, train_step

LAYOUTS = ("tp2", "fsdp2_zero3", "fsdp2_zero2", "ddp2")


def _tp(model, mesh) -> None:
    layer_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for layer in model.llm.layers.values():
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(
        model.llm, mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel()}
    )
    # As neva.parallel.tensor_parallel: the projector's Linears column- then row-parallel.
    parallelize_module(model.projector, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _fsdp(model, mesh, zero: int) -> None:
    reshard = zero == 3
    for layer in model.llm.layers.values():
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model.vision, mesh=mesh, reshard_after_forward=reshard)
    # NevaModel calls ``vision.features``, not ``vision(...)``: FSDP2 must gather around that method.
    register_fsdp_forward_method(model.vision, "features")
    fully_shard(model.projector, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def worker(rank: int, init_file: str, stage: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        results = {}
        for name in LAYOUTS:
            model = tiny_model(stage)
            if name == "tp2":
                _tp(model, mesh)
            elif name.startswith("fsdp2"):
                _fsdp(model, mesh, int(name[-1]))
            else:
                model = DistributedDataParallel(model)
            ids, pixels = batch(model.module if name == "ddp2" else model)
            opt = train_step(model, ids, pixels)
            results[name] = measured_bytes(model, opt)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
