"""The preference stage under DP2 (FSDP2 ZeRO-3, DDP), TP2+SP, PP2 (1F1B) and CP2 equals one process per step
(loss, gradient norm, rewards) and in validation (the pair loss on held-out pairs), with a frozen reference model
(sharded, pipelined too) and with LoRA's adapters-off reference; under CP2 each tower input is encoded by one cp rank;
so do EP2 on a Mixtral-style decoder, AnyRes tiles and recomputed blocks, and bf16 O2 stays within bf16's error. One
spawn of two gloo processes. A PP2 checkpoint resumes in one process on the one-process curve."""

from __future__ import annotations

import csv
import os

import pytest

from .harness import BASE, FAMILIES, make_checkpoint, neva_train, run_layouts, train_losses
from .test_parallel_training import E2E, RTOL, _check_layouts, _tiny_checkpoint

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
MOE = "++model.mm_cfg.llm.arch_overrides={num_layers:2,num_moe_experts:4,moe_aux_loss_coeff:0.1,moe_z_loss_coeff:0.01}"
O2 = ["trainer.precision=bf16-mixed", "model.megatron_amp_O2=true"]


def test_dp2_equals_one_process(tmp_path):
    restore = [f"model.restore_from_path={make_checkpoint(tmp_path / 'ft')}"]
    args = dict(steps=STEPS, base=DPO_BASE)
    refs = {name: train_and_validate(restore + o, **args, count_tower_inputs=True) for name, o in CASES.items()}
    runs = {case: [lay for lay in LAYOUTS if (case, lay) not in UNSUPPORTED] for case in CASES}
    jobs = [
        (f"{case}_{lay}", restore + CASES[case] + LAYOUTS[lay], args) for case, lays in runs.items() for lay in lays
    ]
    # precomputed reference log-probs under PP2: the pass's values are the last stage's (neva.training.reference_logps)
    precomputed = ["model.dpo.precompute_ref_log_probs=true", f"exp_manager.exp_dir={tmp_path / 'precomputed'}"]
    jobs.append(("precomputed_pp2", restore + CASES["full"] + precomputed + LAYOUTS["pp2"], args))
    # the other layouts and settings of finetuning, each once on the full case: experts over two ranks (their own
    # one-process run: a Mixtral-style decoder, the routers' term joining the pair loss), AnyRes tiles under ZeRO-3,
    # recomputed blocks
    moe = [f"model.restore_from_path={make_checkpoint(tmp_path / 'moe', extra=[MOE])}", MOE, *CASES["full"]]
    anyres = [
        f"model.restore_from_path={make_checkpoint(tmp_path / 'anyres', 'llama_clip_anyres')}",
        *FAMILIES["llama_clip_anyres"],
        *CASES["full"],
    ]
    refs |= {"moe": train_and_validate(moe, **args), "anyres": train_and_validate(anyres, **args)}
    jobs += [
        ("moe_ep2", moe + ["model.expert_model_parallel_size=2"], args),
        ("anyres_zero3", anyres + LAYOUTS["zero3"], args),
        ("full_recompute", restore + CASES["full"] + ["model.activations_checkpoint_granularity=full"], args),
        ("full_o2", restore + CASES["full"] + O2, args),
    ]
    # context parallelism: each row's tokens split over the two ranks, the sequences' log-probs (the policy's and the
    # frozen reference's) summed over them before the pair losses
    jobs.append(
        ("full_cp2", restore + CASES["full"] + ["model.context_parallel_size=2"], {**args, "count_tower_inputs": True})
    )
    results = run_layouts(2, jobs, tmp_path / "dp2", train=train_and_validate)
    checked = {case: [f"{case}_{lay}" for lay in lays] for case, lays in runs.items()}
    checked["full"] += ["precomputed_pp2", "full_recompute", "full_cp2"]  # against the live reference's run
    checked |= {"moe": ["moe_ep2"], "anyres": ["anyres_zero3"]}
    for rank in results:  # bf16 O2 (fp32 sharded masters) within bf16's error of the fp32 run
        o2, ref = rank["full_o2"], refs["full"]
        assert o2["param_dtypes"] == ["torch.float32"], o2["param_dtypes"]
        assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(o2["losses"], ref["losses"], strict=True)), (o2, ref)
    for case, ref in refs.items():
        assert ref["aux_metrics"][1]["rewards/margin"] != 0  # the second step's policy is not the reference
        assert "val_rewards/accuracy" in ref["held_out"]
        names = checked[case]
        _check_layouts(results, names, ref)  # losses and gradient norms
        for name in names:
            for rank in results:
                got, want = rank[name]["val_loss"], ref["val_loss"]
                assert abs(got - want) <= RTOL * max(abs(want), 1.0), (name, "val_loss", got, want)
                assert rank[name]["held_out"].keys() == ref["held_out"].keys(), name
                for key, value in ref["held_out"].items():
                    got = rank[name]["held_out"][key]
                    assert abs(got - value) <= RTOL * max(abs(value), 1.0), (name, key, got, value)
                for got, want in zip(rank[name]["aux_metrics"], ref["aux_metrics"], strict=True):
                    for key, value in want.items():
                        assert abs(got[key] - value) <= RTOL * max(abs(value), 1.0), (name, key, got[key], value)
    # CP2: every tower input encoded once, by one cp rank (the ranks' counts sum to one process's, none has them all)
    counts = [rank["full_cp2"]["tower_inputs"] for rank in results]
    want = refs["full"]["tower_inputs"]
    assert sum(counts) == want > 0 and max(counts) < want, (counts, want)


def train_and_validate(overrides: list[str], steps: int, base: list[str], count_tower_inputs: bool = False) -> dict:
    """``train_losses``, then the validation loss (the pair objective on the held-out pairs, the reference's
    log-probs prepared as in training) of the trained model over this rank's validation batches, and the held-out
    metrics (``val_rewards/…``) that validation logs."""
    out = train_losses(overrides, steps=steps, base=base, keep_engine=True, count_tower_inputs=count_tower_inputs)
    engine, data = out.pop("engine"), out.pop("data")
    engine.model.eval()
    out["val_loss"] = engine.evaluate(list(data.val_dataloader()))[0].item()
    out["held_out"] = engine.held_out_metrics()  # the held-out pairs' rewards, as validation logs them
    return out


def test_resume_across_layouts_continues_the_curve(tmp_path):
    """``torchrun -m neva.train +stage=dpo`` under PP2 checkpoints step 2 (a DCP directory); one process resumes it
    and its step 3 (loss, rewards, logps) is the uninterrupted one-process run's, the reference rebuilt from the
    starting weights (not the checkpoint's). Constant learning rate, so legs of different lengths share one curve."""
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    run = [o for o in E2E if o != "+stage=finetune"] + [
        "+stage=dpo", "model.global_batch_size=4", "model.optim.lr=1e-3", "model.optim.sched.name=constant_with_warmup",
        "model.optim.sched.warmup_steps=0", "trainer.max_steps=3",
    ]  # fmt: skip
    ref = _dpo_train(tmp_path / "one", ckpt, 1, *run)
    _dpo_train(tmp_path / "chain", ckpt, 2, *run, "trainer.max_steps=2", "model.pipeline_model_parallel_size=2")
    assert (tmp_path / "chain" / "dpo" / "checkpoints" / "last.ckpt").is_dir()
    resumed = _dpo_train(tmp_path / "chain", ckpt, 1, *run, resumes_at=2)
    assert len(ref) == len(resumed) == 3 and float(ref[2]["rewards/margin"]) != 0
    for got, want in zip(resumed, ref, strict=True):
        for key in ("train_loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "ref_logps/rejected"):
            assert abs(float(got[key]) - float(want[key])) <= RTOL * max(abs(float(want[key])), 1.0), (key, got, want)


def _dpo_train(root, ckpt, nproc: int, *overrides: str, resumes_at: int | None = None) -> list[dict[str, str]]:
    """``python -m neva.train`` (``nproc`` > 1: under torchrun), in processes forked from the harness's server."""
    env = {**os.environ, "NEVA_OUTPUT_ROOT": str(root), "OMP_NUM_THREADS": "1"}
    every = "exp_manager.checkpoint_callback_params.every_n_train_steps=1"
    proc = neva_train([f"model.restore_from_path={ckpt}", *overrides, every], nproc, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = proc.stdout + proc.stderr
    assert resumes_at is None or f"at step {resumes_at}" in output, output[-4000:]
    with open(root / "dpo" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("train_loss")]
