"""Worker of the 2-process gloo memory test: build each layout with training's one construction path and report the
parameters (names and bytes), gradients and optimizer state this rank really holds.

Every layout goes through ``neva.parallel.parallelize`` (pipeline split, ``apply_tensor_parallel``, FSDP2 / DDP) from
``build_meta_model`` and ``resolve_source``, exactly as ``NevaModule.configure_model`` builds it, so the planner's
per-rank numbers are checked against what training allocates.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from neva.checkpoint.source import ModelSource
from neva.config import TrainConfig, compose_config
from neva.models.trainable import build_meta_model
from neva.parallel.layout import Layout
from neva.parallel.parallelize import parallelize
from neva.parallel.precision import Precision
from tests.planner.helpers import batch, measured_bytes, param_bytes, train_step

# Finetune freezing (projector + LLM train, vision frozen) without a pretrained checkpoint: the pretrain stage with the
# LLM unfrozen. 6 decoder layers do not divide into 2 × 2 virtual chunks, so the uneven split is exercised, and a
# first chunk of 2 layers moves a layer between the pipeline ranks.
BASE = [
    "+stage=pretrain",
    "model.mm_cfg.llm.freeze=false",
    "+model.mm_cfg.llm.arch_overrides.num_layers=6",
    "trainer.devices=2",
    "model.micro_batch_size=1",
    "model.global_batch_size=2",
]
LAYOUTS = {
    "tp2": ["model.tensor_model_parallel_size=2"],
    "fsdp2_zero3": ["model.zero_stage=3"],
    "fsdp2_zero2": ["model.zero_stage=2"],
    "ddp2": ["model.data_parallel=ddp"],
    "pp2_first": ["model.pipeline_model_parallel_size=2", "model.pipeline_first_stage_layers=1"],
    "pp2_vpp2": ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
    "pp2_vpp2_first": [
        "model.pipeline_model_parallel_size=2",
        "model.virtual_pipeline_model_parallel_size=2",
        "model.pipeline_first_stage_layers=2",
    ],
}


def layout_configs() -> dict[str, TrainConfig]:
    return {name: compose_config(BASE + overrides) for name, overrides in LAYOUTS.items()}


def worker(rank: int, init_file: str, configs: dict[str, TrainConfig], source: ModelSource, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cpu = torch.device("cpu")
        results = {}
        for name, cfg in configs.items():
            precision = Precision.from_config(cfg.trainer.precision, cfg.model.megatron_amp_O2)
            meta = build_meta_model(source.cfg, cfg.model.trainable_policy())
            model = parallelize(meta, source, Layout.from_config(cfg.model, 2), cfg.model, cpu, precision)
            names = {n for part in model.parts for n, _ in part.named_parameters()}
            if model.runner is None:
                opt = train_step(model.forward_model, *batch(model.parts[0]))
                results[name] = {"names": names, **measured_bytes(model.parts[0], opt)}
            else:  # pipeline stages: parameters only (a step would need the schedule's micro-batches)
                results[name] = {"names": names, "params": sum(param_bytes(part) for part in model.parts)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
