"""Context parallelism (``model.context_parallel_size``) computes the one-process training run (CPU, gloo, fp32).

On LLaVA-format data (long and short samples, text-only and two-image ones), padded and packed, and on micro-batches
mixing video, image + video, image and text rows: CP2 (FSDP2 and DDP) and CP2 × DP2 equal one process step by step;
each tower input is encoded by one cp rank only; a checkpoint written under CP2 resumes in one process on the same
curve. The split itself is checked against a direct computation in process.
"""

from __future__ import annotations

import pytest

from .harness import FAMILIES, make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set
from .test_dpo_layouts import CASES, DPO_BASE

pytestmark = pytest.mark.slow

STEPS = 2  # the second step shows the first update: loss and gradient norm of both compared
TOL = 1e-5
CP2 = ["model.context_parallel_size=2"]
MOE = "++model.mm_cfg.llm.arch_overrides={num_layers:2,num_moe_experts:4,moe_aux_loss_coeff:0.1,moe_z_loss_coeff:0.01}"


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _check(results, name, ref) -> None:
    diffs = [
        (_max_rel(rank[name]["losses"], ref["losses"]), _max_rel(rank[name]["grad_norms"], ref["grad_norms"]))
        for rank in results
    ]
    print(
        f"{name}: max relative difference of loss {max(d[0] for d in diffs):.2e}, grad norm {max(d[1] for d in diffs):.2e}"
    )
    for rank in results:
        assert _max_rel(rank[name]["losses"], ref["losses"]) < TOL, (name, rank[name]["losses"], ref["losses"])
        got, want = rank[name]["grad_norms"], ref["grad_norms"]
        assert _max_rel(got, want) < TOL, (name, got, want)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    write_llava_set(directory, n=32)
    return directory


def test_cp2_matches_one_process(llava_dir, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    video_ckpt = make_checkpoint(tmp_path / "video", "llama_clip_video")
    anyres_ckpt = make_checkpoint(tmp_path / "anyres", "llama_clip_anyres")
    moe_ckpt = make_checkpoint(tmp_path / "moe", extra=[MOE])
    data = {
        "padded": [f"model.restore_from_path={ckpt}", *llava_overrides(llava_dir, False)],
        "packed": [f"model.restore_from_path={ckpt}", *llava_overrides(llava_dir, True)],
        "video": [f"model.restore_from_path={video_ckpt}", *FAMILIES["llama_clip_video"]],
        # LoRA's adapter dropout keyed by sample and position (the keys split with their tokens), blocks recomputed
        "packed_lora_recompute": [
            f"model.restore_from_path={ckpt}",
            *llava_overrides(llava_dir, True),
            "model.peft.peft_scheme=lora",
            "model.activations_checkpoint_granularity=full",
        ],
        # LLaVA's / NeMo's per-micro-batch mean: each micro-batch's own learned tokens, counted before the split
        "packed_micro_batch_mean": [
            f"model.restore_from_path={ckpt}",
            *llava_overrides(llava_dir, True),
            "model.loss_normalization=micro_batch_mean",
        ],
        # Mixtral-style experts: each layer's routing statistics summed over the cp ranks, the router term counted once
        "moe_packed": [f"model.restore_from_path={moe_ckpt}", MOE, *llava_overrides(llava_dir, True)],
        # AnyRes tiles shared out over the cp ranks, laid out (newlines, pooling) after the gather
        "anyres_packed": [
            f"model.restore_from_path={anyres_ckpt}",
            *llava_overrides(llava_dir, True),
            *FAMILIES["llama_clip_anyres"][1:],
        ],
    }
    count = {"count_tower_inputs": True}
    refs = {name: train_losses(d, STEPS, count_tower_inputs=True) for name, d in data.items()}
    jobs = [(f"cp2/{name}", d + CP2, {"steps": STEPS, **count}) for name, d in data.items()]
    ddp = ["model.data_parallel=ddp"]
    jobs.append(("cp2_ddp/packed", data["packed"] + CP2 + ddp, {"steps": STEPS}))
    # whole micro-batches of text or of images, alternating: a text-only one still runs the (empty) shared encode
    alternating = {"steps": STEPS, "kinds": "text_only_alternating"}
    refs["text_only_alternating"] = train_losses([f"model.restore_from_path={ckpt}"], **alternating)
    jobs.append(("cp2_ddp/text_only_alternating", [f"model.restore_from_path={ckpt}", *CP2, *ddp], alternating))
    results = run_layouts(2, jobs, tmp_path / "layouts")
    for name in data:
        _check(results, f"cp2/{name}", refs[name])
        # every tower input encoded once, by one cp rank: the ranks' counts sum to one process's, none has them all
        counts = [rank[f"cp2/{name}"]["tower_inputs"] for rank in results]
        assert sum(counts) == refs[name]["tower_inputs"] > 0, (name, counts, refs[name]["tower_inputs"])
        assert max(counts) < refs[name]["tower_inputs"], (name, counts)
        print(f"cp2/{name}: tower inputs per rank {counts}, one process {refs[name]['tower_inputs']}")
    for rank in results:  # the routers' term and loads: one process's
        for got, want in zip(rank["cp2/moe_packed"]["aux_metrics"], refs["moe_packed"]["aux_metrics"]):
            assert got.keys() == want.keys() and all(abs(got[k] - want[k]) <= 1e-5 * abs(want[k]) for k in want)
    _check(results, "cp2_ddp/packed", refs["packed"])
    _check(results, "cp2_ddp/text_only_alternating", refs["text_only_alternating"])


FOUR_RANK = {
    "cp2_dp2": [],  # FSDP2 over the four ranks: the cp pairs read different micro-batches and split each
    "cp2_tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],  # full logits per shard
    "cp2_pp2": ["model.pipeline_model_parallel_size=2"],  # every stage's attention gathers over its cp pair
}


def test_four_rank_cp_layouts_match_one_process(llava_dir, tmp_path):
    """CP2 × DP2, CP2 × TP2 + SP and CP2 × PP2 equal one process; the preference stage (DPO) under CP2 × TP2 + SP
    too."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    video_ckpt = make_checkpoint(tmp_path / "video", "llama_clip_video")
    data = {
        "padded": [f"model.restore_from_path={ckpt}", *llava_overrides(llava_dir, False)],
        "packed": [f"model.restore_from_path={ckpt}", *llava_overrides(llava_dir, True)],
        "video": [f"model.restore_from_path={video_ckpt}", *FAMILIES["llama_clip_video"]],
    }
    refs = {name: train_losses(d, STEPS) for name, d in data.items()}
    jobs = [(f"{lay}/{name}", d + CP2 + o, STEPS) for lay, o in FOUR_RANK.items() for name, d in data.items()]
    # the preference stage under CP2 x TP2 + SP: its pair head reads the vocab-sharded logits of each cp shard's
    # positions (next_labels) and sums each sequence's log-probs over the cp pair (CP2 alone: test_dpo_layouts)
    dpo = {"steps": STEPS, "base": DPO_BASE}
    refs["dpo"] = train_losses([f"model.restore_from_path={ckpt}", *CASES["full"]], **dpo)
    jobs.append(
        ("cp2_tp2_sp/dpo", [f"model.restore_from_path={ckpt}", *CASES["full"], *CP2, *FOUR_RANK["cp2_tp2_sp"]], dpo)
    )
    results = run_layouts(4, jobs, tmp_path / "layouts")
    for name, _, _ in jobs:
        _check(results, name, refs[name.split("/")[1]])


def test_cp2_checkpoint_resumes_in_one_process(tmp_path):
    """``torchrun -m neva.train`` under CP2 writes a DCP checkpoint at step 2; one process resumes it and continues
    the uninterrupted one-process curve."""
    from .test_parallel_training import FLAT_LR, _tiny_checkpoint, _train

    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    run = [*FLAT_LR, "trainer.max_steps=4"]
    ref = _train(tmp_path / "one", ckpt, 1, *run, every=2)
    cp2 = _train(tmp_path / "run", ckpt, 2, *FLAT_LR, "trainer.max_steps=2", *CP2, every=2)
    assert (tmp_path / "run" / "finetune" / "checkpoints" / "last.ckpt").is_dir()
    resumed = _train(tmp_path / "run", ckpt, 1, *run, every=2)
    print(f"cp2 resume: one process {ref}, cp2 {cp2}, resumed {resumed}")
    assert len(resumed) == 4 and _max_rel(resumed, ref) < TOL, (resumed, ref)
    assert _max_rel(cp2, ref[:2]) < TOL, (cp2, ref)
