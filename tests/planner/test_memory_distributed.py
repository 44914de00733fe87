"""Two gloo processes: predicted per-rank parameter / gradient / AdamW bytes equal the real local shards."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from neva.models.presets import build_config
from neva.planner.memory import rank_state_bytes
from neva.planner.params import inventory, meta_model, stage_layers
from tests.planner.dist_worker import LAYOUTS, worker
from tests.planner.helpers import layout, no_peft, tiny_mm

PREDICTED_LAYOUTS = {
    "tp2": layout(tp=2),
    "fsdp2_zero3": layout(dp=2, zero=3),
    "fsdp2_zero2": layout(dp=2, zero=2),
    "ddp2": layout(dp=2, data_parallel="ddp"),
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["finetune"])
def test_two_rank_state_bytes_are_exact(tmp_path, stage: str) -> None:
    # fork: the children inherit the imported torch/neva modules, which saves most of the test's time.
    args = (str(tmp_path / "init"), stage, str(tmp_path))
    mp.start_processes(worker, args=args, nprocs=2, join=True, start_method="fork")
    infos = inventory(meta_model(build_config(), tiny_mm(stage), no_peft()))
    for rank in range(2):
        real = torch.load(tmp_path / f"rank{rank}.pt")
        for name in LAYOUTS:
            lay = PREDICTED_LAYOUTS[name]
            tp_rank, dp_rank = (rank, 0) if lay.tp > 1 else (0, rank)
            predicted = rank_state_bytes(infos, lay, 0, stage_layers(4, lay), tp_rank=tp_rank, dp_rank=dp_rank)
            got = (predicted.params, predicted.grads, predicted.optimizer)
            want = (real[name]["params"], real[name]["grads"], real[name]["optimizer"])
            assert got == want, f"{name} rank {rank}: predicted {got}, real {want}"
