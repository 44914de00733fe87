"""Offload mode (``--offload``): one optimizer step with and without activation offload (``model.activation_offload``)
and, with two or more GPUs, FSDP2's CPU offload (``model.fsdp_offload``, DP2 under ``torchrun``): the step's loss and
gradient norm (equal: offload moves tensors, it computes nothing) and the peak device memory of each side.

Each side runs ``neva.train``'s own step (``NevaModule``'s engine and optimizer) in a child process of its own, so
the peaks are per side: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS above its state before
the step on the CPU (where offload changes nothing: host and device are one memory). The FSDP2 sides need two GPUs
(FSDP2 shards over data-parallel ranks; on one GPU ``model.fsdp_offload`` is refused) and are skipped otherwise. The GPU shape: a ~1B decoder
(width 2048, 22 layers) under CLIP ViT-L/14 224, bf16 O2, one packed row of ``--offload-seq`` tokens of synthetic
samples; ``--tiny``: the tiny model on the CPU (what the GPU check's test runs).
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
    # DP2 under torchrun (two GPUs): FSDP2 with and without its CPU offload
    "fsdp": [],
    "fsdp_offload": ["model.fsdp_offload=true"],
}


def overrides(args: Any, side: str) -> list[str]:
    return [
        "+stage=pretrain",
        *(TINY if args.tiny else ONE_B),
        "model.data.packing=true",
        f"model.data.seq_length={128 if args.tiny else args.offload_seq}",
        "model.micro_batch_size=16",
        "model.global_batch_size=32" if side.startswith("fsdp") else "model.global_batch_size=16",
        "model.data.synthetic_train_samples=64",
        "model.data.num_workers=0",
        *SIDES[side],
    ]


def run_side(side: str, args: Any) -> dict[str, Any] | None:
    """One step of ``side`` in this process (the child; under torchrun for the FSDP2 sides, whose rank 0 reports:
    the others return None)."""
    import torch

    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.module import NevaModule, StepBatches
    from neva.training.optim import build_optimizer
    from neva.training.run import data_module_type

    if side.startswith("fsdp"):
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
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
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                    - base) / 2**20  # fmt: skip
    if int(os.environ.get("RANK", "0")):
        return None
    return {"side": side, "loss": loss.item(), "grad_norm": float(norm), "peak_gib": peak,
            "peak_of": "device (max_memory_allocated)" if cuda else "process RSS above the start"}  # fmt: skip


def run_offload(args: Any, script: str) -> dict[str, Any]:
    """Each side in a child process; the summary (sides that cannot run here say why)."""
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    gpus = torch.cuda.device_count()
    sides = []
    for side in SIDES:
        child = ["--offload-child", side, *(["--tiny"] if args.tiny else []), "--offload-seq", str(args.offload_seq)]
        if side.startswith("fsdp"):
            if args.tiny or gpus < 2:  # the tiny check's CPU has one memory: DP2 equality is tests/parallel's
                sides.append({"side": side, "skipped": f"FSDP2 shards over data-parallel ranks: {gpus} GPU(s)"})
                continue
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script, *child]
        else:
            cmd = [sys.executable, script, *child]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.offload_timeout)
        if done.returncode:
            sides.append({"side": side, "error": f"rc {done.returncode}: {done.stderr[-600:]}"})
            continue
        sides.append(json.loads(done.stdout.strip().splitlines()[-1]))
    by = {s["side"]: s for s in sides}
    for side, against in (("activation_offload", "plain"), ("fsdp_offload", "fsdp")):
        s, ref = by[side], by[against]
        if "loss" in s and "loss" in ref:  # the same step: equal loss and norm, less device memory
            s["loss_rel_diff"] = abs(s["loss"] - ref["loss"]) / abs(ref["loss"])
            s["grad_norm_rel_diff"] = abs(s["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"])
            s["peak_saved_gib"] = ref["peak_gib"] - s["peak_gib"]
    for s in sides:
        print(json.dumps(s))
    return {"mode": "offload", "sides": sides}
