"""Offload mode (``--offload``): one optimizer step without offload, with activation offload
(``model.activation_offload``) and with FSDP2's CPU offload (``model.fsdp_offload``, one process under a process
group of one): the step's loss and gradient norm (equal: offload moves tensors; FSDP2's mixed-precision policy casts as
O2's master weights do) and the peak device memory of each side.

Each side runs ``neva.train``'s own step (``NevaModule``'s engine and optimizer) in a child process of its own, so
the peaks are per side: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS above its state before
the step on the CPU (where offload changes nothing: host and device are one memory). The GPU shape: a ~1B decoder
(width 2048, 22 layers) under CLIP ViT-L/14 224, bf16 O2, one packed row of ``--offload-seq`` tokens of synthetic
samples; ``--tiny``: the tiny model on the CPU, every side in this one process (what the GPU check's test runs).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from typing import Any

ONE_B = [
    "model=llama2_7b",
    "vision=clip_vit_l14_224",
    "++model.mm_cfg.llm.arch_overrides={hidden_size:2048,intermediate_size:5632,num_layers:22,num_heads:32,"
    "num_kv_heads:4,max_seq_len:8192}",
    "trainer.precision=bf16",
    "model.megatron_amp_O2=true",
]
TINY = ["trainer.accelerator=cpu", "++model.mm_cfg.llm.arch_overrides={num_layers:2}"]
SIDES = {
    "plain": [],
    "activation_offload": ["model.activation_offload=true"],
    # one process under a process group of one: FSDP2 holds the whole model's state on the host
    "fsdp_offload": ["model.fsdp_offload=true"],
}


def overrides(args: Any, side: str) -> list[str]:
    return [
        "+stage=pretrain",
        *(TINY if args.tiny else ONE_B),
        "model.data.packing=true",
        f"model.data.seq_length={128 if args.tiny else args.offload_seq}",
        "model.micro_batch_size=16",
        "model.global_batch_size=16",
        "model.data.synthetic_train_samples=64",
        "model.data.num_workers=0",
        *SIDES[side],
    ]


def run_side(side: str, args: Any) -> dict[str, Any]:
    """One step of ``side`` in this process (the child)."""
    import torch

    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.module import NevaModule, StepBatches
    from neva.training.optim import build_optimizer
    from neva.training.run import data_module_type

    if side == "fsdp_offload":  # what neva.train's strategy sets up for it: a process group of one
        import socket

        import torch.distributed as dist

        with socket.socket() as free:  # a port nothing else listens on
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cfg = compose_config(overrides(args, side))
    layout = resolve_layout(cfg)
    source = resolve_source(cfg)
    dm = data_module_type(cfg)(
        cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=cfg.model.micro_batch_size,
        dp_rank=layout.dp_rank, dp_world=layout.dp, seed=cfg.model.seed, accumulation=layout.grad_accum,
    )  # fmt: skip
    dm.setup("fit")
    module = NevaModule(cfg, source, dm, layout)
    module.configure_model()
    engine = module.engine
    optimizer = build_optimizer(engine.named_trainable_parameters(), cfg.model.optim)
    step = next(iter(StepBatches(dm, layout.grad_accum)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss, _, norm = engine.optimizer_step(optimizer, step, clip=1.0)
    if side == "fsdp_offload":
        import torch.distributed as dist

        dist.destroy_process_group()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                    - base) / 2**20  # fmt: skip
    return {"side": side, "loss": loss.item(), "grad_norm": float(norm), "peak_gib": peak,
            "peak_of": "device (max_memory_allocated)" if cuda else "process RSS above the start"}  # fmt: skip


def run_offload(args: Any, script: str) -> dict[str, Any]:
    """Each side in a child process; the summary (sides that cannot run here say why)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sides = []
    if args.tiny:  # the CPU check of the code path: one process (on the CPU the peaks say nothing anyway)
        sides = [run_side(side, args) for side in SIDES]
    for side in () if args.tiny else SIDES:
        child = ["--offload-child", side, *(["--tiny"] if args.tiny else []), "--offload-seq", str(args.offload_seq)]
        done = subprocess.run([sys.executable, script, *child], capture_output=True, text=True, env=env,
                              timeout=args.offload_timeout)  # fmt: skip
        if done.returncode:
            sides.append({"side": side, "error": f"rc {done.returncode}: {done.stderr[-600:]}"})
            continue
        sides.append(json.loads(done.stdout.strip().splitlines()[-1]))
    by = {s["side"]: s for s in sides}
    for side, against in (("activation_offload", "plain"), ("fsdp_offload", "plain")):
        s, ref = by[side], by[against]
        if "loss" in s and "loss" in ref:  # the same step: equal loss and norm, less device memory
            s["loss_rel_diff"] = abs(s["loss"] - ref["loss"]) / abs(ref["loss"])
            s["grad_norm_rel_diff"] = abs(s["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"])
            s["peak_saved_gib"] = ref["peak_gib"] - s["peak_gib"]
    for s in sides:
        print(json.dumps(s))
    return {"mode": "offload", "sides": sides}
