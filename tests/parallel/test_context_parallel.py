"""Context parallelism (``model.context_parallel_size``) computes the one-process training run (CPU, gloo, fp32).

On LLaVA-format data (long and short samples, text-only and two-image ones), padded and packed, and on micro-batches
mixing video, image + video, image and text rows: CP2 (FSDP2 and DDP) and CP2 × DP2 equal one process step by step,
native-resolution Qwen2.5-VL (CP2; an imported one on videos too) and Qwen3-VL (DeepStack; every layout) too; each
tower input (a native tower's patches) is encoded by one cp rank only; bf16 O2 under CP2 stays within bf16's error of
the fp32 run; a checkpoint written under CP2 resumes in one process and one written by one process resumes under CP2,
on the same curve. The split itself is checked against a direct computation in process.
"""

from __future__ import annotations

import pytest

from .harness import BASE, FAMILIES, make_checkpoint, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set
from .test_dpo_layouts import CASES, DPO_BASE

pytestmark = pytest.mark.slow

STEPS = 2  # the second step shows the first update: loss and gradient norm of both compared
TOL = 1e-5
CP2 = ["model.context_parallel_size=2"]
O2 = ["trainer.precision=bf16-mixed", "model.megatron_amp_O2=true"]
NATIVE = ("qwen2_5_vl_native", "qwen3_vl_native")
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
    # native resolution: whole images (each its own patch grid) shared out by patches; Qwen2.5-VL's window and full
    # blocks, Qwen3-VL's DeepStack features written at each rank's positions like the merger's
    for family in NATIVE:
        native_ckpt = make_checkpoint(tmp_path / family, family)
        data[f"{family}_packed"] = [
            f"model.restore_from_path={native_ckpt}",
            *FAMILIES[family],
            *llava_overrides(llava_dir, True),
            "model.data.conv_template=chatml",
        ]
    count = {"count_tower_inputs": True}
    refs = {name: train_losses(d, STEPS, count_tower_inputs=True) for name, d in data.items()}
    jobs = [(f"cp2/{name}", d + CP2, {"steps": STEPS, **count}) for name, d in data.items()]
    ddp = ["model.data_parallel=ddp"]
    jobs.append(("cp2_ddp/packed", data["packed"] + CP2 + ddp, {"steps": STEPS}))
    jobs.append(("cp2_o2/packed", data["packed"] + CP2 + O2, {"steps": STEPS}))  # bf16 compute, fp32 sharded masters
    # whole micro-batches of text or of images, alternating: a text-only one still runs the (empty) shared encode
    alternating = {"steps": STEPS, "kinds": "text_only_alternating"}
    refs["text_only_alternating"] = train_losses([f"model.restore_from_path={ckpt}"], **alternating)
    jobs.append(("cp2_ddp/text_only_alternating", [f"model.restore_from_path={ckpt}", *CP2, *ddp], alternating))
    # native video: an imported Qwen2.5-VL (its video token: frames as temporal patches through the same tower and
    # merger) on images, videos and text; whole videos shared out by patches like images
    qwen_video = _imported_qwen_video(tmp_path / "qwen_video")
    video_run = {"steps": STEPS, "base": [o for o in BASE if "arch_overrides" not in o]}  # the import's architecture
    refs["qwen2_5_vl_imported_video"] = train_losses(qwen_video, **video_run, **count)
    jobs.append(("cp2/qwen2_5_vl_imported_video", qwen_video + CP2, {**video_run, **count}))
    results = run_layouts(2, jobs, tmp_path / "layouts")
    for name in [*data, "qwen2_5_vl_imported_video"]:
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
    for rank in results:  # bf16 O2 against the fp32 run, within bf16's error (the tolerance of the other O2 layouts)
        o2 = rank["cp2_o2/packed"]
        assert o2["param_dtypes"] == ["torch.float32"], o2["param_dtypes"]
        assert _max_rel(o2["losses"], refs["packed"]["losses"]) < 2e-2, (o2, refs["packed"])
        assert _max_rel(o2["grad_norms"], refs["packed"]["grad_norms"]) < 5e-2, (o2, refs["packed"])
    _check(results, "cp2_ddp/text_only_alternating", refs["text_only_alternating"])


def _imported_qwen_video(root) -> list[str]:
    """Overrides training an imported tiny Qwen2.5-VL on LLaVA records of images, text and four mp4 videos of 5-14
    frames at two sizes (``model.data.num_frames=4``: two temporal patches each)."""
    import json

    from neva.checkpoint.hf_qwen_vl import import_qwen_vl
    from tests.data.video_files import write_video
    from tests.fixtures.tiny_qwen_vl import tiny_qwen_vl_dir

    path, images = write_llava_set(root / "data", n=20)
    records = json.loads(path.read_text())
    for i in range(4):
        write_video(images / f"clip{i}.mp4", 5 + 3 * i, size=32 + 16 * (i % 2))
        reply = "The colours change. " * (i + 1)
        records.insert(2 * i, {"id": f"v{i}", "video": f"clip{i}.mp4", "conversations": [
            {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": reply}]})  # fmt: skip
    path.write_text(json.dumps(records))
    ckpt = import_qwen_vl(tiny_qwen_vl_dir(root / "hf", "qwen2_5_vl"), root / "neva")
    return [f"model.restore_from_path={ckpt}", "data=llava", f"model.data.data_path={path}",
            f"model.data.image_folder={images}", "model.data.conv_template=qwen2_vl", "model.data.num_workers=0",
            "model.data.packing=true", "model.data.num_frames=4"]  # fmt: skip


FOUR_RANK = {
    "cp2_dp2": [],  # FSDP2 over the four ranks: the cp pairs read different micro-batches and split each
    "cp2_tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],  # full logits per shard
    "cp2_pp2": ["model.pipeline_model_parallel_size=2"],  # every stage's attention gathers over its cp pair
}


# Expert groups drawn from dp × cp: EP2 is each dp rank's cp pair (the all-to-all trades the pair's chunks), EP4 spans
# both dp ranks and both cp ranks (one expert per rank)
EXPERT_LAYOUTS = {"cp2_ep2": ["model.expert_model_parallel_size=2"], "cp2_ep4": ["model.expert_model_parallel_size=4"]}


def test_four_rank_cp_layouts_match_one_process(llava_dir, tmp_path):
    """CP2 × DP2, CP2 × TP2 + SP and CP2 × PP2 equal one process; Qwen3-VL's native tower too (its DeepStack
    additions sequence-split under SP, on PP's first stage); so do CP2 × EP2 and CP2 × EP4 on a tiny MoE (loss with
    the routers' term, gradient norm, the routers' term and loads; CP2 × EP4 under bf16 O2 within bf16's error), and
    the preference stage (DPO) under CP2 × TP2 + SP. Qwen3.5's hybrid decoder under CP2 × DP2: its linear-attention
    layers pass the convolution's inputs and the recurrent state from chunk to chunk over each cp pair."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    video_ckpt = make_checkpoint(tmp_path / "video", "llama_clip_video")
    qwen3_ckpt = make_checkpoint(tmp_path / "qwen3", "qwen3_vl_native")
    moe_ckpt = make_checkpoint(tmp_path / "moe", extra=[MOE])
    hybrid_ckpt = make_checkpoint(tmp_path / "qwen3_5", "qwen3_5_native")
    data = {
        "padded": [f"model.restore_from_path={ckpt}", *llava_overrides(llava_dir, False)],
        "packed": [f"model.restore_from_path={ckpt}", *llava_overrides(llava_dir, True)],
        "video": [f"model.restore_from_path={video_ckpt}", *FAMILIES["llama_clip_video"]],
        "qwen3_vl_native_packed": [
            f"model.restore_from_path={qwen3_ckpt}",
            *FAMILIES["qwen3_vl_native"],
            *llava_overrides(llava_dir, True),
            "model.data.conv_template=chatml",
        ],
    }
    moe = [f"model.restore_from_path={moe_ckpt}", MOE, *llava_overrides(llava_dir, True)]
    hybrid = [f"model.restore_from_path={hybrid_ckpt}", *FAMILIES["qwen3_5_native"], *llava_overrides(llava_dir, True)]
    hybrid.append("model.data.conv_template=chatml")
    refs = {name: train_losses(d, STEPS) for name, d in {**data, "moe_packed": moe, "qwen3_5_packed": hybrid}.items()}
    jobs = [(f"{lay}/{name}", d + CP2 + o, STEPS) for lay, o in FOUR_RANK.items() for name, d in data.items()]
    jobs.append(("cp2_dp2/qwen3_5_packed", hybrid + CP2 + FOUR_RANK["cp2_dp2"], STEPS))
    jobs += [(f"{lay}/moe_packed", moe + CP2 + o, STEPS) for lay, o in EXPERT_LAYOUTS.items()]
    # the preference stage under CP2 x TP2 + SP: its pair head reads the vocab-sharded logits of each cp shard's
    # positions (next_labels) and sums each sequence's log-probs over the cp pair (CP2 alone: test_dpo_layouts)
    dpo = {"steps": STEPS, "base": DPO_BASE}
    refs["dpo"] = train_losses([f"model.restore_from_path={ckpt}", *CASES["full"]], **dpo)
    jobs.append(
        ("cp2_tp2_sp/dpo", [f"model.restore_from_path={ckpt}", *CASES["full"], *CP2, *FOUR_RANK["cp2_tp2_sp"]], dpo)
    )
    # bf16 O2 with experts over dp × cp: fp32 sharded masters of the experts too, within bf16's error of fp32
    o2 = ("cp2_ep4_o2/moe_packed", moe + CP2 + EXPERT_LAYOUTS["cp2_ep4"] + O2, STEPS)
    results = run_layouts(4, [*jobs, o2], tmp_path / "layouts")
    for name, _, _ in jobs:
        _check(results, name, refs[name.split("/")[1]])
    for rank in results:
        got, want = rank[o2[0]], refs["moe_packed"]
        assert got["param_dtypes"] == ["torch.float32"], got["param_dtypes"]
        assert _max_rel(got["losses"], want["losses"]) < 2e-2 and _max_rel(got["grad_norms"], want["grad_norms"]) < 5e-2
    for rank in results:  # the routers' term and loads: one process's
        for lay in EXPERT_LAYOUTS:
            for got, want in zip(rank[f"{lay}/moe_packed"]["aux_metrics"], refs["moe_packed"]["aux_metrics"]):
                assert got.keys() == want.keys(), lay
                assert all(abs(got[k] - want[k]) <= 1e-5 * abs(want[k]) for k in want), (lay, got, want)


def test_cp2_checkpoint_resumes_in_one_process(tmp_path):
    """``torchrun -m neva.train`` under CP2 writes a DCP checkpoint at step 2; one process resumes it for a step and
    writes a checkpoint file; CP2 resumes that: every step continues the uninterrupted one-process curve."""
    from .test_parallel_training import FLAT_LR, _tiny_checkpoint, _train

    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    ref = _train(tmp_path / "one", ckpt, 1, *FLAT_LR, "trainer.max_steps=4", every=4)
    cp2 = _train(tmp_path / "run", ckpt, 2, *FLAT_LR, "trainer.max_steps=2", *CP2, every=2)
    assert (tmp_path / "run" / "finetune" / "checkpoints" / "last.ckpt").is_dir()
    one = _train(tmp_path / "run", ckpt, 1, *FLAT_LR, "trainer.max_steps=3", every=1)
    assert (tmp_path / "run" / "finetune" / "checkpoints" / "last.ckpt").is_file()
    resumed = _train(tmp_path / "run", ckpt, 2, *FLAT_LR, "trainer.max_steps=4", *CP2, every=4)
    print(f"cp2 resume: one process {ref}, cp2 {cp2}, one process after cp2 {one}, cp2 after that {resumed}")
    assert _max_rel(cp2, ref[:2]) < TOL, (cp2, ref)
    assert len(one) == 3 and _max_rel(one, ref[:3]) < TOL, (one, ref)
    assert len(resumed) == 4 and _max_rel(resumed, ref) < TOL, (resumed, ref)
