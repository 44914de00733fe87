"""Every parallel layout computes the single-process training run (CPU, gloo, real processes, fp32).

The in-process harness (``harness.py``) runs ``NevaModule``'s step without Lightning, grouping layouts so each
spawn pays process start-up once; the end-to-end tests run the command ``python -m neva.train`` (under torchrun's
environment for several ranks) in processes forked from the harness's server (``harness.neva_train``), and
``test_torchrun_end_to_end`` runs it under the real ``torchrun`` launcher too.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .harness import FAMILIES, make_checkpoint, neva_train, run_layouts, train_losses
from .llava_data import llava_overrides, write_llava_set

STEPS = 5
RTOL = 1e-5

pytestmark = pytest.mark.slow


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    restore = [f"model.restore_from_path={ckpt}"]
    ref = train_losses(restore, STEPS)
    # Clipping (trainer.gradient_clip_val) acts: the gradient norm, one all-reduce over every layout's shards, matters.
    assert max(ref["grad_norms"]) > 1.0
    return restore, ref


TWO_RANK_LAYOUTS = {
    "tp2": ["model.tensor_model_parallel_size=2"],
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "pp2_1f1b": ["model.pipeline_model_parallel_size=2"],
    "pp2_interleaved": ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
    "dp2_fsdp": ["model.data_parallel=fsdp"],
    "dp2_ddp": ["model.data_parallel=ddp"],
}

FOUR_RANK_LAYOUTS = {
    "tp2_dp2": ["model.tensor_model_parallel_size=2"],
    "pp2_tp2": ["model.pipeline_model_parallel_size=2", "model.tensor_model_parallel_size=2"],
}


def _check_layouts(results, names, ref) -> None:
    """Losses and gradient norms of every rank of every layout equal the one-process run's."""
    for name in names:
        for rank in results:
            assert _max_rel(rank[name]["losses"], ref["losses"]) < RTOL, (name, rank[name]["losses"], ref)
            assert _max_rel(rank[name]["grad_norms"], ref["grad_norms"]) < RTOL, (name, rank[name]["grad_norms"], ref)


def test_two_rank_layouts_match_one_process(reference, tmp_path):
    restore, ref = reference
    jobs = [(name, restore + o, STEPS) for name, o in TWO_RANK_LAYOUTS.items()]
    jobs.append(("dp2_fsdp_o2", restore + ["trainer.precision=bf16-mixed", "model.megatron_amp_O2=true"], 2))
    results = run_layouts(2, jobs, tmp_path)
    _check_layouts(results, TWO_RANK_LAYOUTS, ref)
    for rank in results:  # O2: bf16 compute, fp32 (sharded) master weights on every rank
        assert rank["dp2_fsdp_o2"]["param_dtypes"] == ["torch.float32"]
        assert abs(rank["dp2_fsdp_o2"]["losses"][0] - ref["losses"][0]) / ref["losses"][0] < 2e-2
        assert abs(rank["dp2_fsdp_o2"]["grad_norms"][0] - ref["grad_norms"][0]) / ref["grad_norms"][0] < 2e-2


def test_four_rank_layouts_match_one_process(reference, tmp_path):
    restore, ref = reference
    results = run_layouts(4, [(n, restore + o, STEPS) for n, o in FOUR_RANK_LAYOUTS.items()], tmp_path)
    _check_layouts(results, FOUR_RANK_LAYOUTS, ref)


# On LLaVA-format data micro-batches differ in length and image count between steps and between data-parallel
# replicas (text-only, two-image and multi-turn samples; modality-grouped batches).
LLAVA_FOUR_RANK_LAYOUTS = {
    "pp2_dp2_zero3": ["model.pipeline_model_parallel_size=2"],
    "pp2_dp2_zero2": ["model.pipeline_model_parallel_size=2", "model.zero_stage=2"],
    "pp2_dp2_ddp": ["model.pipeline_model_parallel_size=2", "model.data_parallel=ddp"],
    "tp2_dp2": ["model.tensor_model_parallel_size=2"],
    "pp2_tp2": ["model.pipeline_model_parallel_size=2", "model.tensor_model_parallel_size=2"],
}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    write_llava_set(directory)
    return directory


# Unpacked and ungrouped, replicas' padded shapes differ from step to step (new pipeline schedules on one replica
# only, unless the replicas agree on each step's shape); packed with LLaVA's modality grouping, every batch is one
# modality.
LLAVA_CASES = {
    "padded": (["model.data.group_by_modality_length=false"], False, list(LLAVA_FOUR_RANK_LAYOUTS), 10),
    "packed_grouped": (
        ["model.data.group_by_modality_length=true"],
        True,
        ["pp2_dp2_zero3", "tp2_dp2", "pp2_tp2"],
        STEPS,
    ),
}


@pytest.mark.parametrize("case", sorted(LLAVA_CASES))
def test_four_rank_layouts_match_one_process_on_llava_data(reference, llava_dir, tmp_path, case):
    restore, _ = reference
    extra, packing, names, steps = LLAVA_CASES[case]
    data = restore + llava_overrides(llava_dir, packing) + extra
    ref = train_losses(data, steps)
    results = run_layouts(4, [(n, data + LLAVA_FOUR_RANK_LAYOUTS[n], steps) for n in names], tmp_path)
    _check_layouts(results, names, ref)


PRETRAIN_LAYOUTS = {
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "tp2": ["model.tensor_model_parallel_size=2"],
    "dp2_fsdp": [],
}


def test_projector_only_training_with_text_only_batches_matches_one_process(reference, llava_dir, tmp_path):
    """Pretraining's freeze policy (only the projector trains) on LLaVA data whose modality-grouped epoch holds a
    text-only global batch: the projector stays in the graph, the second pipeline stage (nothing to train) keeps an
    empty optimizer, a text-only micro-batch enters the pipeline with an empty image batch."""
    restore, _ = reference
    data = restore + llava_overrides(llava_dir, False) + ["model.mm_cfg.llm.freeze=true"]
    data.append("model.data.group_by_modality_length=true")
    steps = 8  # the whole epoch (64 samples, global batch 8): the text-only group is in it
    ref = train_losses(data, steps)["losses"]
    results = run_layouts(2, [(n, data + o, steps) for n, o in PRETRAIN_LAYOUTS.items()], tmp_path)
    for name in PRETRAIN_LAYOUTS:
        for rank in results:
            assert _max_rel(rank[name]["losses"], ref) < RTOL, (name, rank[name]["losses"], ref)


LORA_LAYOUTS = {
    "dp2_fsdp": [],
    "dp2_ddp": ["model.data_parallel=ddp"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
}


def test_lora_with_dropout_matches_one_process(reference, llava_dir, tmp_path):
    """LoRA's adapter dropout (default 0.05) is keyed by sample and position, so it splits over replicas and
    pipeline stages like everything else."""
    restore, _ = reference
    data = restore + llava_overrides(llava_dir, False) + ["model.peft.peft_scheme=lora"]
    ref = train_losses(data, STEPS)["losses"]
    results = run_layouts(2, [(n, data + o, STEPS) for n, o in LORA_LAYOUTS.items()], tmp_path)
    for name in LORA_LAYOUTS:
        for rank in results:
            assert _max_rel(rank[name]["losses"], ref) < RTOL, (name, rank[name]["losses"], ref)


E2E = [
    "+stage=finetune",
    "trainer.max_steps=5",
    "model.micro_batch_size=2",
    "model.global_batch_size=8",
    "exp_manager.create_tensorboard_logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.val_check_interval=1000",
    "trainer.log_every_n_steps=1",
    "++model.data.synthetic_train_samples=48",
    "++model.data.pad_to_multiple_of=16",
    "++model.mm_cfg.llm.arch_overrides={num_layers:2}",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=3",
]


def _train(
    root: Path,
    ckpt: Path,
    nproc: int,
    *overrides: str,
    column: str = "train_loss",
    every: int = 3,
    torchrun: bool = False,
) -> list[float]:
    """``python -m neva.train`` (``nproc`` > 1: under torchrun) on the tiny finetune run; its ``column`` per step.
    The command runs in forked processes (``harness.neva_train``); ``torchrun``: in the real launcher and
    interpreters."""
    env = {**os.environ, "NEVA_OUTPUT_ROOT": str(root), "OMP_NUM_THREADS": "1"}
    base = [o for o in E2E if "every_n_train_steps" not in o]
    base.append(f"exp_manager.checkpoint_callback_params.every_n_train_steps={every}")
    argv = base + [f"model.restore_from_path={ckpt}", *overrides]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "neva.train"]
        proc = subprocess.run(launcher + argv, env=env, capture_output=True, text=True, timeout=600)
    else:
        proc = neva_train(argv, nproc, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(root / "finetune" / "metrics.csv") as f:
        return [float(r[column]) for r in csv.DictReader(f)]


def _tiny_checkpoint(directory: Path, *overrides: str) -> Path:
    import torch

    from neva.checkpoint.neva_format import save_checkpoint
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.models.neva import NevaModel

    base = ["+stage=pretrain", "++model.mm_cfg.llm.arch_overrides={num_layers:2}", *overrides]
    source = resolve_source(compose_config(base))
    torch.manual_seed(0)
    model = NevaModel(source.cfg)
    model.init_weights()
    return save_checkpoint(directory, source.cfg, model.state_dict(), source.tokenizer)


# The learning rate then does not depend on max_steps, so legs of different lengths continue one curve.
FLAT_LR = ["model.optim.lr=1e-3", "model.optim.sched.min_lr=1e-3", "model.optim.sched.warmup_steps=0"]


def test_resume_scales_out_and_back_one_process_dp2_tp2_one_process(tmp_path):
    """One process writes a checkpoint file; DP2 (FSDP2) resumes it and writes a DCP directory; TP2 resumes that;
    one process resumes TP2's: every step equals the uninterrupted one-process run."""
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    ref = _train(tmp_path / "one", ckpt, 1, *FLAT_LR)
    chain = tmp_path / "chain"
    _train(chain, ckpt, 1, *FLAT_LR, "trainer.max_steps=2", every=1)
    assert (chain / "finetune" / "checkpoints" / "last.ckpt").is_file()
    _train(chain, ckpt, 2, *FLAT_LR, "trainer.max_steps=3", every=1)
    assert (chain / "finetune" / "checkpoints" / "last.ckpt").is_dir()
    _train(chain, ckpt, 2, *FLAT_LR, "trainer.max_steps=4", "model.tensor_model_parallel_size=2", every=1)
    resumed = _train(chain, ckpt, 1, *FLAT_LR, every=1)
    assert _max_rel(resumed, ref) < RTOL, (resumed, ref)


def test_o2_checkpoint_of_fsdp_resumes_in_one_process(tmp_path):
    """bf16 O2 under DP2 (FSDP2's fp32 sharded parameters) saves a DCP directory; one process with O2 (fp32 master
    copies of bf16 parameters) resumes it and steps like the DP2 run does (bf16 compute: a loose tolerance)."""
    import shutil

    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    o2 = ["trainer.precision=bf16-mixed", "model.megatron_amp_O2=true", *FLAT_LR]
    _train(tmp_path / "dp2", ckpt, 2, *o2, "trainer.max_steps=3", every=1)
    shutil.copytree(tmp_path / "dp2", tmp_path / "one")
    dp2 = _train(tmp_path / "dp2", ckpt, 2, *o2, "trainer.max_steps=4", every=1)
    one = _train(tmp_path / "one", ckpt, 1, *o2, "trainer.max_steps=4", every=1)
    assert one[:3] == dp2[:3]
    assert abs(one[3] - dp2[3]) / dp2[3] < 2e-2, (one, dp2)


def test_resumed_schedule_is_the_same_whoever_wrote_the_checkpoint(tmp_path):
    """Resumed with a longer ``trainer.max_steps``, the learning rate follows the new schedule from the saved step,
    whether one process (a file) or two (a DCP directory) wrote the checkpoint."""
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    fresh = _train(tmp_path / "fresh", ckpt, 1, "trainer.max_steps=6", column="lr")
    for nproc in (1, 2):
        root = tmp_path / f"writer{nproc}"
        _train(root, ckpt, nproc, "trainer.max_steps=3", every=1)
        lrs = _train(root, ckpt, 1, "trainer.max_steps=6", column="lr")
        assert lrs[3:] == pytest.approx(fresh[3:], rel=1e-9), (nproc, lrs, fresh)


def test_torchrun_end_to_end_and_layout_changing_resume(tmp_path):
    """``torchrun -m neva.train`` with TP2 writes the one-process ``train_loss`` values; a DCP checkpoint saved
    under TP2 at step 3 resumes under DP2 (FSDP2), and in one process, and both continue the same curve."""
    import torch

    from neva.checkpoint.neva_format import save_checkpoint
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.models.neva import NevaModel

    source = resolve_source(compose_config(["+stage=pretrain", "++model.mm_cfg.llm.arch_overrides={num_layers:2}"]))
    torch.manual_seed(0)
    model = NevaModel(source.cfg)
    model.init_weights()
    ckpt = save_checkpoint(tmp_path / "ckpt", source.cfg, model.state_dict(), source.tokenizer)

    ref = _train(tmp_path / "one", ckpt, 1)
    tp = _train(tmp_path / "tp", ckpt, 2, "model.tensor_model_parallel_size=2", torchrun=True)
    assert _max_rel(tp, ref) < RTOL, (tp, ref)
    # Sharded initialisation (no rank ever holds the whole model) loads the same weights.
    meta = _train(tmp_path / "tp_meta", ckpt, 2, "model.tensor_model_parallel_size=2", "model.meta_init=true")
    assert _max_rel(meta, ref) < RTOL, (meta, ref)
    assert (tmp_path / "tp" / "finetune" / "final").is_dir()

    checkpoints = tmp_path / "tp" / "finetune" / "checkpoints"
    last = checkpoints / "last.ckpt"
    import shutil

    step3 = tmp_path / "tp_step3"
    shutil.copytree(checkpoints / "step=3.ckpt", step3)
    shutil.rmtree(last)
    shutil.copytree(step3, last)
    resumed = _train(tmp_path / "tp", ckpt, 2, "model.data_parallel=fsdp")
    assert _max_rel(resumed, ref) < RTOL, (resumed, ref)

    # The same TP2 checkpoint resumed by one process (TP1): DCP gathers the shards into full tensors.
    shutil.rmtree(last)
    shutil.copytree(step3, last)
    single = _train(tmp_path / "tp", ckpt, 1)
    assert _max_rel(single, ref) < RTOL, (single, ref)


def test_hf_weights_load_straight_into_the_sharded_model(tmp_path):
    """``model.meta_init=true`` under TP2: HF Llama + CLIP weights are read tensor by tensor into each rank's shards."""
    from safetensors.torch import load_file

    from tests.checkpoint.tiny_hf import make_clip_dir, make_llama_dir

    llama, _ = make_llama_dir(tmp_path / "llama")
    make_clip_dir(tmp_path / "clip")
    env = {**os.environ, "NEVA_OUTPUT_ROOT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    argv = [
        "+stage=pretrain", "trainer.max_steps=2", "model.micro_batch_size=2", "model.global_batch_size=4",
        "exp_manager.create_tensorboard_logger=false", "trainer.enable_progress_bar=false",
        "trainer.val_check_interval=1000", "++model.data.synthetic_train_samples=16",
        f"model.mm_cfg.llm.from_pretrained={tmp_path}/llama", f"model.mm_cfg.vision_encoder.from_pretrained={tmp_path}/clip",
        "model.tensor_model_parallel_size=2", "model.meta_init=true",
    ]  # fmt: skip
    proc = neva_train(argv, 2, env)  # torchrun --nproc_per_node 2 -m neva.train
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = tmp_path / "out" / "pretrain" / "final"
    weights = {}
    for f in sorted(final.glob("*.safetensors")):
        weights.update(load_file(f))
    hf = llama.state_dict()
    # Pretraining froze the LLM: the gathered weights are HF's, whichever rank held which slice.
    assert torch.equal(weights["llm.layers.1.feed_forward.w2.weight"], hf["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(weights["llm.output.weight"][: hf["lm_head.weight"].shape[0]], hf["lm_head.weight"])


# The new parameter kinds of issue 20 in one family, each layout once on LLaVA data (padded): SigLIP's patch bias
# (replicated tower on stage 0), mlp_downsample's LayerNorm (replicated between a column- and a row-parallel Linear),
# Qwen2's q/k/v biases (sharded with their columns) under TP2+SP, PP2, DP2 ZeRO-3 from a sharded (meta) start;
# Qwen2's tied embeddings (refused with PP) under TP2+SP, DP2 ZeRO-3, and DP2 DDP with full activation checkpointing;
# two bf16 O2 steps on each (the tied one recomputed). One spawn for all of them; then a DCP checkpoint of the tied
# family written under TP2+SP resumes in one process on the uninterrupted curve.
FAMILY_LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    # sharded initialisation: each rank allocates and loads only its shards of the checkpoint
    "dp2_zero3_meta": ["model.data_parallel=fsdp", "model.zero_stage=3", "model.meta_init=true"],
    # plain DDP with every block recomputed in backward: the tied tensor's two gradients and the biases' through the
    # recomputation, all-reduced once
    "dp2_ddp_recompute": ["model.data_parallel=ddp", "model.activations_checkpoint_granularity=full"],
}
FAMILY_CASES = {
    "siglip_qwen2_downsample": ["tp2_sp", "pp2", "dp2_zero3_meta"],
    "siglip_qwen2_tied_downsample": ["tp2_sp", "dp2_zero3_meta", "dp2_ddp_recompute"],
    # Video (issue 24): micro-batches mixing video, image + video, image and text rows (``harness.media_steps``),
    # frames through the tower on stage 0, pooled, spliced at the collator's video positions
    "llama_clip_video": ["tp2_sp", "pp2", "dp2_zero3_meta"],
}
O2 = ["trainer.precision=bf16-mixed", "model.megatron_amp_O2=true"]


def test_family_layouts_match_one_process_and_resume_across_layouts(llava_dir, tmp_path):
    steps = 3  # a shared tensor trained apart, or a bias stepped wrongly, shows from the second step
    jobs, refs, data = [], {}, {}
    for family, names in FAMILY_CASES.items():
        ckpt = make_checkpoint(tmp_path / family, family)
        data[family] = [f"model.restore_from_path={ckpt}", *FAMILIES[family], *llava_overrides(llava_dir, False)]
        refs[family] = train_losses(data[family], steps)
        jobs += [(f"{family}/{n}", data[family] + FAMILY_LAYOUTS[n], steps) for n in names]
    # bf16 O2 (FSDP2's policy: DP2), two steps: the second loss shows the first update; on the tied family with
    # recomputation too (one fp32 master of the shared tensor, fp32 bias masters)
    o2_jobs = {
        "o2": ("siglip_qwen2_downsample", []),
        "o2_tied_recompute": ("siglip_qwen2_tied_downsample", ["model.activations_checkpoint_granularity=full"]),
    }
    jobs += [(name, data[family] + O2 + extra, 2) for name, (family, extra) in o2_jobs.items()]
    results = run_layouts(2, jobs, tmp_path / "layouts")
    for name, _, _ in jobs[: -len(o2_jobs)]:
        _check_layouts(results, [name], refs[name.split("/")[0]])
    for rank in results:  # O2: bf16 compute, fp32 (sharded) master weights, the projector's LayerNorm included
        for name, (family, _) in o2_jobs.items():
            o2, ref = rank[name], refs[family]
            assert o2["param_dtypes"] == ["torch.float32"]
            assert _max_rel(o2["losses"], ref["losses"][:2]) < 2e-2, (name, o2, ref)
            assert _max_rel(o2["grad_norms"], ref["grad_norms"][:2]) < 5e-2, (name, o2, ref)

    tied = FAMILIES["siglip_qwen2_tied_downsample"]
    e2e = _tiny_checkpoint(tmp_path / "e2e_ckpt", *tied)
    run = [*FLAT_LR, *tied, *llava_overrides(llava_dir, False), "trainer.max_steps=3"]
    tp = _train(tmp_path / "run", e2e, 2, *run, *FAMILY_LAYOUTS["tp2_sp"], every=2)
    checkpoints = tmp_path / "run" / "finetune" / "checkpoints"
    shutil.rmtree(checkpoints / "last.ckpt")
    shutil.copytree(checkpoints / "step=2.ckpt", checkpoints / "last.ckpt")  # DCP, written under TP2+SP
    resumed = _train(tmp_path / "run", e2e, 1, *run, every=2)
    assert len(resumed) == 3 and _max_rel(resumed, tp) < RTOL, (resumed, tp)


# AnyRes: packed micro-batches mixing grids (LLaVA data: 40x30, 32x32, 64x48, 20x50, 50x20 images), pooled
# (anyres_max_1) and unpooled tiled images, fixed-size ones (two-image samples) and text-only samples, each image its
# own token count; TP2+SP, PP2 (the tiles and the pooling weights on stage 0), DP2 ZeRO-3 = one process.
ANYRES_LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "dp2_zero3": ["model.data_parallel=fsdp", "model.zero_stage=3"],
}


def test_anyres_mixed_packed_batches_match_one_process(llava_dir, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama_clip_anyres")
    data = [f"model.restore_from_path={ckpt}", *llava_overrides(llava_dir, True), *FAMILIES["llama_clip_anyres"][1:]]
    ref = train_losses(data, 2)
    results = run_layouts(2, [(n, data + o, 2) for n, o in ANYRES_LAYOUTS.items()], tmp_path / "layouts")
    _check_layouts(results, ANYRES_LAYOUTS, ref)


def test_anyres_and_video_under_pp2_write_final_equal_to_one_process(llava_dir, tmp_path):
    """``torchrun -m neva.train`` under PP2 writes ``final`` for an AnyRes model (its ``image_newline`` lives on stage 0,
    ``neva.parallel.stage_owners``) and a video model; the final weights and the greedy answers equal the one-process
    run's."""
    import numpy as np

    from neva.checkpoint.neva_format import iter_tensors
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    image = next((llava_dir / "images").iterdir())
    frames = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    cases = {
        "anyres": (FAMILIES["llama_clip_anyres"], [*llava_overrides(llava_dir, False), FAMILIES["llama_clip_anyres"][1]],
                   ("What is in the image?", [image], [])),
        "video": (FAMILIES["llama_clip_video"], ["data=synthetic_video", "model.data.num_frames=4"],
                  ("Which way does it move?", [], [frames])),
    }  # fmt: skip
    for name, (family, data, item) in cases.items():
        ckpt = _tiny_checkpoint(tmp_path / name / "ckpt", *family)
        finals = []
        for nproc, layout in ((1, []), (2, ["model.pipeline_model_parallel_size=2"])):
            root = tmp_path / name / f"np{nproc}"
            _train(root, ckpt, nproc, *data, *layout, "trainer.max_steps=2", every=2)
            finals.append(root / "finetune" / "final")
        one, pp2 = (dict(iter_tensors(f)) for f in finals)
        assert one.keys() == pp2.keys() and (name != "anyres" or "anyres.image_newline" in one)
        for key, tensor in one.items():
            # AdamW divides by the root of the squared gradients: a near-zero gradient's float-rounding difference
            # moves its weight by up to ~lr * 1e-2 (measured 6e-6 on weights of ~0.1 after two steps)
            torch.testing.assert_close(pp2[key], tensor, rtol=1e-5, atol=2e-5, msg=key)
        answers = [Answerer(f, GenerationConfig(max_new_tokens=6)).answer([item])[0] for f in finals]
        assert answers[0] == answers[1], (name, answers)
