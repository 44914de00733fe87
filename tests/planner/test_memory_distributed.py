"""Two gloo processes: predicted per-rank parameter / gradient / AdamW bytes equal what training really allocates
(TP, FSDP2 ZeRO-3 / ZeRO-2, DDP; pipeline stages with a first-stage layer count and with virtual chunks)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.multiprocessing as mp

from neva.checkpoint.source import resolve_source
from neva.parallel.layout import mesh_coords
from neva.planner.deployment import deployment_from_config
from neva.planner.memory import rank_state_bytes
from neva.planner.params import model_inventory, on_stage, stage_layers
from tests.planner.dist_worker import layout_configs, worker


@pytest.mark.slow
def test_two_rank_state_bytes_are_exact(tmp_path) -> None:
    configs = layout_configs()
    source = resolve_source(next(iter(configs.values())))
    # fork: the children inherit the imported torch/neva modules and the configs, which saves most of the time.
    args = (str(tmp_path / "init"), configs, source, str(tmp_path))
    mp.start_processes(worker, args=args, nprocs=2, join=True, start_method="fork")
    measured = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for name, cfg in configs.items():
        dep = deployment_from_config(cfg)
        infos = model_inventory(source.cfg, cfg.model.trainable_policy())
        layers = stage_layers(source.cfg.llm.num_layers, dep.layout)
        for rank in range(2):
            real = measured[rank][name]
            pp_rank, dp_rank, _, tp_rank = mesh_coords(rank, dep.layout)
            held, real_names = {p.name for p in infos if on_stage(p, pp_rank, layers)}, real.pop("names")
            assert held == real_names, (
                f"{name} rank {rank}: only predicted {held - real_names}, only real {real_names - held}"
            )
            state = rank_state_bytes(infos, dep, pp_rank, layers, tp_rank=tp_rank, dp_rank=dp_rank)
            got = {k: v for k, v in asdict(state).items() if k in real}  # pipeline stages report parameters only
            assert got == real, f"{name} rank {rank}: predicted {got}, real {real}"
