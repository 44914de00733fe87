"""Worker of the 2-process gloo memory test: shard the tiny model with neva's own engine and report real bytes.

TP2 and FSDP2 (ZeRO-3 / ZeRO-2) go through ``neva.parallel`` (``apply_tensor_parallel``, ``apply_fsdp``), so the
planner's per-rank numbers are checked against exactly what training allocates; DDP is torch's wrapper.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from neva.parallel.data_parallel import apply_fsdp
from neva.parallel.tensor_parallel import apply_tensor_parallel
from tests.planner.helpers import batch, measured_bytes, tiny_model, train_step

LAYOUTS = ("tp2", "fsdp2_zero3", "fsdp2_zero2", "ddp2")


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
                apply_tensor_parallel(model, mesh, sequence_parallel=False, vocab_parallel_loss=False)
            elif name.startswith("fsdp2"):
                apply_fsdp(model, mesh, param_dtype=None, reshard=name.endswith("3"))
            else:
                model = DistributedDataParallel(model)
            ids, pixels = batch(model.module if name == "ddp2" else model)
            opt = train_step(model, ids, pixels)
            results[name] = measured_bytes(model, opt)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
