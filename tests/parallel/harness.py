"""Multi-process CPU harness: the training loop of ``NevaModule`` without Lightning, in N gloo processes; and
``run_module``, a command ``python -m module`` (``neva.train`` under torchrun's environment too) in processes forked
from the same server.

Lean on purpose (CI has 2 cores): one process group per set of layouts, forked from a server that has imported
everything once, a 2-layer tiny model, short sequences.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fixtures.checkpoints import save_tiny_checkpoint

# Workers fork from one server process that has imported torch, Lightning and neva once for the whole session, instead
# of a fresh interpreter per rank importing them again (~5 s of CPU each, on CI's 2 cores, for every group of layouts).
# The server never runs an OpenMP region, so its children are safe to fork, unlike the test process itself.
multiprocessing.set_forkserver_preload(["tests.parallel.harness", "neva.training.module", "neva.data.datamodule"])

BASE = [
    "+stage=finetune",
    "model.micro_batch_size=2",
    "model.global_batch_size=8",
    "trainer.max_steps=5",
    "trainer.enable_progress_bar=false",
    "trainer.val_check_interval=1000",
    "trainer.log_every_n_steps=1",
    "exp_manager.create_tensorboard_logger=false",
    "++model.data.synthetic_train_samples=48",
    "++model.data.synthetic_val_samples=8",
    "++model.data.pad_to_multiple_of=16",
    "++model.mm_cfg.llm.arch_overrides={num_layers:4}",
    "model.optim.sched.warmup_steps=1",
]


# Model families of the layout cases: architecture overrides on top of ``BASE`` (a checkpoint made with them gives
# the architecture to every run restored from it). Decoder families join here; a case names one.
FAMILIES: dict[str, list[str]] = {
    "llama_clip": [],
    # SigLIP tower (patch-embedding bias, no CLS), NeMo's mlp_downsample projector (its LayerNorm; 4 image tokens) and
    # a Qwen2 decoder (q/k/v biases sharded with their columns), untied so that PP2 applies
    "siglip_qwen2_downsample": [
        "model=tiny_qwen2",
        "++model.mm_cfg.llm.arch_overrides={num_layers:4,tie_word_embeddings:false}",
        "model.mm_cfg.vision_encoder.preset=tiny_siglip",
        "model.mm_cfg.mm_mlp_adapter_type=mlp_downsample",
    ],
    # the same with Qwen2's tied embeddings (one tensor, vocab-sharded for the embedding and the head under TP)
    "siglip_qwen2_tied_downsample": [
        "model=tiny_qwen2",
        "model.mm_cfg.vision_encoder.preset=tiny_siglip",
        "model.mm_cfg.mm_mlp_adapter_type=mlp_downsample",
    ],
    # Video on the tiny CLIP: frames pooled 2x2 per frame (4 tokens a frame) before the projector; the steps are
    # hand-built batches of the collator's contract (``media_steps``) mixing video, image + video, image and text rows
    "llama_clip_video": ["model.mm_cfg.mm_spatial_pool_stride=2"],
    # Qwen2.5-VL's native-resolution tower (windows, one full block) and RMSNorm merger on the tiny Qwen2 decoder with
    # M-RoPE (three position axes per token), untied so that PP2 applies: every image its own grid
    "qwen2_5_vl_native": [
        "model=tiny_qwen2_5_vl",
        "vision=tiny_qwen2_5_vl",
        "++model.mm_cfg.llm.arch_overrides={num_layers:4,tie_word_embeddings:false,mrope_section:[4,6,6]}",
    ],
    # Qwen3-VL: DeepStack features joining decoder layers 0 and 1 (of 4: both on PP2's first stage), q / k norms,
    # interleaved M-RoPE
    "qwen3_vl_native": ["model=tiny_qwen3_vl", "vision=tiny_qwen3_vl"],
    # Qwen3-VL-MoE: the same decoder with 4 experts of width 64 in every block (the qwen3_moe family)
    "qwen3_vl_moe_native": [
        "model=tiny_qwen3_vl",
        "vision=tiny_qwen3_vl",
        "++model.mm_cfg.llm.arch_overrides={family:qwen3_moe,num_moe_experts:4,intermediate_size:64,"
        "mrope_section:[8,4,4],mrope_interleaved:true}",
    ],
    # Gemma 3: interleaved sliding (window 16) / global layers with their own RoPE bases, q / k norms, four norms per
    # block, scaled embeddings, bidirectional attention inside each image; the gemma3 projector (pool, RMSNorm, linear)
    # behind its SigLIP's post-LayerNorm features; untied so that PP2 applies
    "gemma3": ["model=tiny_gemma3", "vision=tiny_gemma3"],
    # Qwen3.5: the hybrid decoder (Gated DeltaNet in layers 0-2, gated attention in layer 3) behind Qwen3-VL's tower
    # without DeepStack; its MoE twin: 4 experts of width 64 and a gated shared expert in every block
    "qwen3_5_native": ["model=tiny_qwen3_5", "vision=tiny_qwen3_5"],
    "qwen3_5_moe_native": [
        "model=tiny_qwen3_5",
        "vision=tiny_qwen3_5",
        "++model.mm_cfg.llm.arch_overrides={family:qwen3_5_moe,num_moe_experts:4,intermediate_size:64,"
        "moe_shared_expert_intermediate_size:64,moe_shared_expert_gate:true,mrope_section:[2,1,1],"
        "mrope_interleaved:true}",
    ],
    # InternVL 3: the tiny InternViT (class token dropped, layer scale), the pixel shuffle + LayerNorm + MLP projector
    # and a Qwen2 decoder, untied so that PP2 applies; every image 1 to 12 tiles of 32 px plus a thumbnail
    "internvl_tiles": ["model=tiny_internvl", "vision=tiny_internvl"],
    # GLM-4.1V: interpolated learned positions, the downsampling SwiGLU merger, four norms per decoder layer and M-RoPE over half of each head
    "glm4v_native": ["model=tiny_glm4v", "vision=tiny_glm4v"],
    # Mistral 3: the tiny Pixtral tower (2-D rotary, attention within each image) and Mistral 3's projector (RMSNorm,
    # 2×2 merge, Linear-GELU-Linear: three Linear layers sharded column-, row-, column-wise) on the tiny decoder as
    # Mistral's, untied so that PP2 applies; every image its own grid, each row of tokens closed by [IMG_BREAK]
    "mistral3_pixtral": [
        "model=tiny_mistral3",
        "vision=tiny_pixtral",
        "++model.mm_cfg.llm.arch_overrides={num_layers:4,family:mistral,tie_word_embeddings:false}",
    ],
    # AnyRes on the tiny CLIP (32 px tiles): 1x1, 1x2, 2x1 and 2x2 grids, spatial_unpad + image_newline, with
    # LLaVA-OneVision's anyres_max_1: every grid above one tile's features pooled (bilinear), a 1x1 grid not, and
    # the images of two-image samples one fixed-size padded tile each
    "llama_clip_anyres": [
        "model.mm_cfg.image_grid_pinpoints=[[32,32],[32,64],[64,32],[64,64]]",
        "model.data.image_aspect_ratio=anyres_max_1",
    ],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(
    directory: Path, family: str = "llama_clip", base: list[str] | None = None, extra: list[str] | None = None
) -> Path:
    """A seeded tiny neva checkpoint of ``family`` (and ``extra`` overrides) matching ``base`` (default ``BASE``; the
    finetune stage's start)."""
    pretrain = [o.replace("+stage=finetune", "+stage=pretrain") for o in (base or BASE)]
    return save_tiny_checkpoint(directory, pretrain + FAMILIES[family] + (extra or []))


def train_losses(
    overrides: list[str],
    steps: int,
    keep_engine: bool = False,
    kinds: str | None = None,
    base: list[str] | None = None,
    count_tower_inputs: bool = False,
    from_data: bool = False,
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps as ``NevaModule.training_step`` does; returns losses, gradient norms (before
    clipping), the auxiliary objectives' metrics and parameter dtypes (``keep_engine``: the trained engine and its data
    module too, for in-process checks). A video model, or ``kinds`` (a ``ROW_KINDS`` name), trains on hand-built
    micro-batches (``media_steps``). ``base``: the overrides under ``overrides`` (default ``BASE``).
    ``count_tower_inputs``: also return how many tower inputs this rank's vision tower encoded (a forward hook on its
    patch embedding, which every tower input passes once; a native-resolution tower: the patches its first block
    reads). ``from_data``: a video model trains on its data module's batches too."""
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.module import NevaModule, StepBatches
    from neva.training.optim import build_optimizer, build_scheduler
    from neva.training.run import data_module_type

    cfg = compose_config((BASE if base is None else base) + overrides)
    layout = resolve_layout(cfg)
    source = resolve_source(cfg)
    data = data_module_type(cfg)(
        cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=cfg.model.micro_batch_size,
        dp_rank=layout.dp_rank, dp_world=layout.dp, seed=cfg.model.seed, accumulation=layout.grad_accum,
        min_micro_batches=layout.pp if cfg.model.pipeline_schedule != "gpipe" else 1,
    )  # fmt: skip
    data.setup("fit")
    accum = layout.grad_accum
    module = NevaModule(cfg, source, data, layout)
    module.configure_model()
    engine = module.engine
    native = source.cfg.vision is not None and source.cfg.vision.spec.patch_grid
    tower_inputs = [0]
    if count_tower_inputs:
        for part in engine.parts:
            if part.vision is not None:  # a native tower runs its patch embedding as a Linear (no module call)
                counted = part.vision.layers["0"] if native else part.vision.patch_embed
                counted.register_forward_hook(
                    lambda mod, args, out: tower_inputs.__setitem__(0, tower_inputs[0] + args[0].shape[0])
                )
    optimizer = build_optimizer(engine.named_trainable_parameters(), cfg.model.optim)
    scheduler = build_scheduler(optimizer, cfg.model.optim, cfg.trainer.max_steps)
    from neva.training.tower_work import tower_patch_metrics

    losses, grad_norms, aux, tower, counts = [], [], [], [], []
    if (source.cfg.video is not None or kinds is not None) and not from_data:
        steps_of = media_steps(source.cfg, layout, steps, kinds or "video")
    else:
        steps_of = StepBatches(data, accum)
    for i, micro_batches in enumerate(steps_of):
        if i == steps:
            break
        engine.model.train()
        loss, _ = engine.forward_backward(micro_batches, step=i)
        grad_norms.append(engine.clip_grad_norm(cfg.trainer.gradient_clip_val).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.after_optimizer_step()
        scheduler.step()
        losses.append(loss.item())
        counts.append(len(micro_batches))
        aux.append(engine.aux_metrics)
        if native:  # metrics.csv's tower patches per data-parallel rank (NevaModule._log_step)
            tower.append(tower_patch_metrics(micro_batches, engine.dp_group, engine.device))
    dtypes = sorted({str(p.dtype) for _, p in engine.named_trainable_parameters()})
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "aux_metrics": aux,
        "param_dtypes": dtypes,
        "tower_patches": tower,
        "micro_batches": counts,
        **({"tower_inputs": tower_inputs[0]} if count_tower_inputs else {}),
        **({"engine": engine, "data": data} if keep_engine else {}),
    }


# Row kinds of the hand-built micro-batches (``media_steps``).
VIDEO, IMAGE_AND_VIDEO, IMAGE, TEXT = 0, 1, 2, 3
ROW_KINDS = {
    # video, image + video, image and text rows mixed in every micro-batch
    "video": lambda step, m, r, micro: (step + m * micro + r) % 4,
    # whole micro-batches of text or of images, alternating: under DP2 one rank's micro-batch is text only while the
    # other's has images, and the other way round at the next step
    "text_only_alternating": lambda step, m, r, micro: TEXT if (step + m) % 2 == 0 else IMAGE,
}


def media_steps(
    cfg: Any, layout: Any, steps: int, kinds: str = "video", micro: int = 2, length: int = 48
) -> list[list[dict[str, Any]]]:
    """Seeded micro-batches of videos, images and text (``ROW_KINDS[kinds]``), shaped as the collator's contract
    (``neva/data/collate.py``: the batch's ``media``, frames and images uint8 in row order, then position order);
    this rank's share (the same global batch for every layout).
    Video and image tokens share one id (``video_token_id`` None): the positions alone tell them apart."""
    from neva.constants import IGNORE_INDEX
    from neva.data.micro_batch import MicroBatch
    from neva.models.media import Media, MediaInputs

    gen = torch.Generator().manual_seed(1234)
    side, token = cfg.vision.image_size, cfg.video_token

    def text(n: int) -> list[int]:
        return torch.randint(1, cfg.image_token_id - 1, (n,), generator=gen).tolist()

    def row(kind: int, r: int, mb: dict[str, list]) -> tuple[list[int], list[int]]:
        ids = text(3)
        for media in {VIDEO: ["video"], IMAGE_AND_VIDEO: ["image", "video"], IMAGE: ["image"], TEXT: []}[kind]:
            start = len(ids)
            if media == "image":
                ids += [cfg.image_token_id] * cfg.num_image_tokens
                mb["pixel_values"].append(torch.randint(0, 256, (1, 3, side, side), dtype=torch.uint8, generator=gen))
                mb["image_positions"] += [(r, c) for c in range(start, len(ids))]
                mb["image_counts"][r] += 1
            else:
                frames = 2 + kind
                ids += [token] * cfg.video_tokens(frames)
                mb["video_pixel_values"].append(
                    torch.randint(0, 256, (frames, 3, side, side), dtype=torch.uint8, generator=gen)
                )
                mb["video_frames"].append(frames)
                mb["video_positions"] += [(r, c) for c in range(start, len(ids))]
            ids += text(1)
        answer = text(6)
        return ids + answer, [IGNORE_INDEX] * len(ids) + answer

    out = []
    for step in range(steps):
        mbs = []
        for m in range(layout.grad_accum * layout.dp):
            mb: dict[str, list] = {k: [] for k in ("pixel_values", "image_positions", "video_pixel_values",
                                                   "video_frames", "video_positions")}  # fmt: skip
            mb["image_counts"] = [0] * micro
            ids_B = torch.zeros(micro, length, dtype=torch.long)
            labels_B = torch.full((micro, length), IGNORE_INDEX, dtype=torch.long)
            real = torch.zeros(micro, length, dtype=torch.long)
            for r in range(micro):
                ids, labels = row(ROW_KINDS[kinds](step, m, r, micro), r, mb)
                ids_B[r, : len(ids)], labels_B[r, : len(ids)] = torch.tensor(ids), torch.tensor(labels)
                real[r, : len(ids)] = 1
            batch = MicroBatch(
                input_ids=ids_B, labels=labels_B, segment_ids=real,
                position_ids=torch.arange(length).expand(micro, length).clone(),
                media=Media(
                    image=MediaInputs(torch.cat(mb["pixel_values"]),
                                      torch.tensor(mb["image_positions"], dtype=torch.long).reshape(-1, 2),
                                      items_per_row=torch.tensor(mb["image_counts"]))
                    if mb["pixel_values"] else None,
                    video=MediaInputs(torch.cat(mb["video_pixel_values"]),
                                      torch.tensor(mb["video_positions"], dtype=torch.long).reshape(-1, 2),
                                      frames=torch.tensor(mb["video_frames"], dtype=torch.long))
                    if mb["video_frames"] else None,
                ),
            )  # fmt: skip
            mbs.append(batch)
        out.append(mbs[layout.dp_rank * layout.grad_accum : (layout.dp_rank + 1) * layout.grad_accum])
    return out


def _worker(rank: int, world: int, port: int, jobs: list, out: str, train=None) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train = train or train_losses
    results = {}
    try:
        for name, overrides, args in jobs:
            results[name] = train(overrides, **args) if isinstance(args, dict) else train(overrides, args)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def run_layouts(world: int, jobs: list[tuple[str, list[str], Any]], out: Path, train=None) -> list[dict[str, Any]]:
    """Run each ``(name, overrides, steps)`` job in ``world`` gloo processes; per-rank results. ``train`` (default
    ``train_losses``; a module-level function, for the spawned processes) runs one job: ``train(overrides, steps)``,
    or ``train(overrides, **kwargs)`` when the job's third item is a dict of keyword arguments."""
    out.mkdir(parents=True, exist_ok=True)
    args = (world, free_port(), jobs, str(out), train)
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="forkserver")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


# torchrun's variables for each worker (torch/distributed/elastic/agent/server/local_elastic_agent.py): one node, the
# first attempt, the launcher's own store not in use.
def _torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(world), "WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False", "OMP_NUM_THREADS": "1",
    }  # fmt: skip


def _command_worker(rank: int, world: int, port: int, module: str, argv: list, env: dict, cwd: str, out: str) -> None:
    """One rank of ``python -m module *argv``: the state a fresh interpreter would have (environment, working
    directory, threads, ``sys.argv``, stdout and stderr to files), then the module run as ``__main__``; the exit status
    to ``rank<r>.rc``. A failed rank leaves with its status, so that the others are stopped as torchrun stops them."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    if world > 1:
        launcher = _torchrun_env(rank, world, port)
        if "OMP_NUM_THREADS" in env:  # torchrun sets it only where the environment has none
            del launcher["OMP_NUM_THREADS"]
        os.environ.update(launcher)
    os.chdir(cwd)
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for fd, name in ((1, "out"), (2, "err")):
        os.dup2(os.open(Path(out, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [module, *argv]  # runpy puts the module's path first, as `python -m` does
    sys.modules.pop(module, None)  # run afresh as __main__ (runpy warns about a module imported before)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    Path(out, f"rank{rank}.rc").write_text(str(code))
    if code:
        os._exit(code)


def run_module(
    module: str,
    argv: list[str],
    nproc: int = 1,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """``python -m module *argv`` (``nproc`` > 1: ``torchrun --nproc_per_node nproc -m module *argv``) as
    ``subprocess.run(..., env=env, cwd=cwd, capture_output=True, text=True)`` returns it, without starting an
    interpreter: each rank is a process forked from the harness's server (torch, Lightning and neva imported once for
    the session, where a fresh interpreter spends ~6 s of CPU on CI's VM importing them), with the launcher's
    environment, running the module as ``__main__``. stdout and stderr: the ranks' in rank order; the exit status: the
    first failing rank's, else 0. For commands whose test is not about the interpreter or the launcher: exit statuses
    of refused inputs, signals, import-time output and torchrun itself keep real processes."""
    with tempfile.TemporaryDirectory(prefix="run_module_") as out:
        env = dict(os.environ if env is None else env)
        args = (nproc, free_port(), module, list(argv), env, str(cwd or os.getcwd()), out)
        context = mp.start_processes(_command_worker, args=args, nprocs=nproc, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=5):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.kill()
                    raise subprocess.TimeoutExpired(["-m", module, *argv], timeout)
        except mp.ProcessExitedException:
            pass  # a rank's non-zero status, read below; the others were stopped
        codes, text = [], {"out": "", "err": ""}
        for rank, process in enumerate(context.processes):
            rc = Path(out, f"rank{rank}.rc")
            codes.append(int(rc.read_text()) if rc.exists() else process.exitcode)
            for name in text:
                if Path(out, f"rank{rank}.{name}").exists():
                    text[name] += Path(out, f"rank{rank}.{name}").read_text()
        failed = [c for c in codes if c]
        return subprocess.CompletedProcess(["-m", module, *argv], failed[0] if failed else 0, text["out"], text["err"])


def neva_train(argv: list[str], nproc: int = 1, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m neva.train *argv`` (``nproc`` > 1: under torchrun) through ``run_module``."""
    return run_module("neva.train", argv, nproc, env)
