"""The preference stage under DP2 (FSDP2 ZeRO-3, DDP), TP2+SP and PP2 (1F1B) equals one process per step (loss,
gradient norm, rewards), with a frozen reference model (sharded, pipelined too) and with LoRA's adapters-off
reference. One spawn of two gloo processes."""

from __future__ import annotations

import pytest

from .harness import BASE, make_checkpoint, run_layouts, train_losses
from .test_parallel_training import RTOL, _check_layouts

pytestmark = pytest.mark.slow

STEPS = 2
# HF's linear warmup would hold the first step at lr 0 (BASE's one warmup step): none here, so both steps train
DPO_BASE = [o for o in BASE if o not in ("+stage=finetune", "model.optim.sched.warmup_steps=1")] + [
    "+stage=dpo",
    "model.optim.sched.warmup_steps=0",
]
CASES = {
    "full": ["model.global_batch_size=4"],
    "lora": ["model.global_batch_size=4", "model.peft.peft_scheme=lora", "model.mm_cfg.freeze_projector=true"],
}
# DDP cannot wrap a model without gradients: a DDP run's frozen reference is FSDP2-sharded (neva.training.dpo)
LAYOUTS = {
    "zero3": ["model.data_parallel=fsdp", "model.zero_stage=3"],
    "ddp": ["model.data_parallel=ddp"],
    # vocab-sharded logits at every position (the pair head under loss_parallel), sequence-parallel activations
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    # the pairs' rows reach the last stage in one micro-batch; the reference runs a forward-only pipeline pass
    "pp2": ["model.pipeline_model_parallel_size=2"],
}
UNSUPPORTED = {("lora", "tp2_sp")}  # LoRA under TP is refused by neva (parallel/tensor_parallel.py), any stage


def test_dp2_equals_one_process(tmp_path):
    restore = [f"model.restore_from_path={make_checkpoint(tmp_path / 'ft')}"]
    args = dict(steps=STEPS, base=DPO_BASE)
    refs = {name: train_losses(restore + o, **args) for name, o in CASES.items()}
    runs = {case: [lay for lay in LAYOUTS if (case, lay) not in UNSUPPORTED] for case in CASES}
    jobs = [
        (f"{case}_{lay}", restore + CASES[case] + LAYOUTS[lay], args) for case, lays in runs.items() for lay in lays
    ]
    results = run_layouts(2, jobs, tmp_path / "dp2")
    for case, ref in refs.items():
        assert ref["aux_metrics"][1]["rewards/margin"] != 0  # the second step's policy is not the reference
        names = [f"{case}_{lay}" for lay in runs[case]]
        _check_layouts(results, names, ref)  # losses and gradient norms
        for name in names:
            for rank in results:
                for got, want in zip(rank[name]["aux_metrics"], ref["aux_metrics"], strict=True):
                    for key, value in want.items():
                        assert abs(got[key] - value) <= RTOL * max(abs(value), 1.0), (name, key, got[key], value)
