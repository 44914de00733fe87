"""CPU mode: neva's training step against HF ``LlavaForConditionalGeneration`` with a plain AdamW loop.

Each side runs in its own child process (``run_side``) so that peak resident memory is measured per side; the
parent (``run_cpu``) starts them one after the other on the same sample stream and compares.

Same semantics on both sides: identical initial weights (neva's init, copied into HF through the checkpoint key
table), identical samples in identical order, the stage's trainable policy (vision tower frozen, projector + LLM in
finetune, projector only in pretrain), AdamW with the same hyperparameters, gradient clipping at 1.0, and the loss =
mean token cross-entropy over the global batch's learned tokens (the two first-step losses are printed so this can be
checked). neva's side is built by training's own path (``bench.build``); the HF side applies the same policy to HF's
module names.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from bench.build import build_engine, stage_config
from bench.data import PAD_ID, StreamSpec, collate_hf, make_batches, real_tokens
from neva.config import TrainConfig
from neva.models.config import NevaConfig
from neva.models.presets import LLM_PRESETS, VISION_PRESETS, build_config
from neva.models.trainable import TrainablePolicy

# Mid-size shapes: small enough for 2 CPU cores, but with Llama-2's 32000 vocabulary (its LM head is a real part
# of the cost) and a ViT whose unused last layer is a visible share of the vision work.
CPU_VISION = dict(image_size=112, patch_size=14, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4)
CPU_LLM = dict(
    vocab_size=32000,
    hidden_size=384,
    intermediate_size=1024,
    num_layers=8,
    num_heads=6,
    num_kv_heads=6,
    max_seq_len=2048,
)


# --smoke: the same code path with the embedded tiny model (16 image tokens, GQA) and short samples, in seconds.
SMOKE_TEXT = dict(text_median=24.0, text_min=8, text_max=64)


# --family: what each model family changes in the shapes above (and in the tiny ones under --smoke); the HF side
# builds the same family from the export's config (``llava_config_dict``). One entry per family.
_QWEN2 = dict(family="qwen2", qkv_bias=True, tie_word_embeddings=True, rope_theta=1e6)
FAMILIES: dict[str, dict[str, dict]] = {
    "llama": {"llm": {}, "vision": {}},
    # Qwen2's q/k/v biases, tied embeddings (as its small models) and rope θ 1e6 (the tiny_qwen2 preset's).
    "qwen2": {"llm": _QWEN2, "vision": {}},
    # The same Qwen2 behind the tower as SigLIP (no class token, tanh-GELU, biased patch embedding; HF
    # SiglipVisionModel on the HF side): LLaVA-OneVision's pairing at the benchmark's shapes.
    "siglip_qwen2": {
        "llm": _QWEN2,
        "vision": dict(kind="siglip", layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh"),
    },
    # Mixtral's sparse MoE feed-forward: 8 experts, top-2 (Mixtral-8x7B's routing), each expert of the dense width.
    # No router loss on either side: HF's LlavaForConditionalGeneration trains the cross-entropy alone (it never
    # adds its language model's load-balancing loss), so neva's coefficient is 0 for the same objective; neva
    # still computes the routing statistics it logs.
    "mixtral": {
        "llm": dict(family="mixtral", num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.0, rope_theta=1e6),
        "vision": {},
    },
    # Qwen2.5-VL: the Qwen2 decoder with M-RoPE behind a native-resolution tower and its patch merger, against HF
    # Qwen2_5_VLForConditionalGeneration (``bench.qwen_vl``: its tower shapes, images of random sizes).
    "qwen2_5_vl": {"llm": _QWEN2, "vision": {}},
    # Gemma 3 against Gemma3ForConditionalGeneration (``bench.gemma3``: its decoder traits, SigLIP tower and projector).
    "gemma3": {"llm": {}, "vision": {}},
    # Qwen3.5: the hybrid decoder (Gated DeltaNet in 3 of every 4 layers, gated attention with RoPE on a quarter of
    # each head) behind Qwen3-VL's tower without DeepStack, against HF Qwen3_5ForConditionalGeneration
    # (``bench.qwen_vl``: the decoder's and tower's shapes there).
    "qwen3_5": {"llm": {}, "vision": {}},
    # InternVL 3: the Qwen2 decoder behind InternViT and the pixel shuffle projector, against HF
    # InternVLForConditionalGeneration (``bench.internvl``: its tower shapes, 1 to 7 tiles per image).
    "internvl": {"llm": _QWEN2, "vision": {}},
    # GLM-4.1V: the decoder as GLM-4's (four norms per layer, partial M-RoPE) behind its tower (interpolated learned
    # positions) and downsampling merger, against HF Glm4vForConditionalGeneration (``bench.glm4v``).
    "glm4v": {"llm": {}, "vision": {}},
    # Mistral 3: the decoder as Mistral behind Pixtral (each image its own size, rows closed by break tokens) and
    # Mistral 3's projector, against HF Mistral3ForConditionalGeneration (``bench.mistral3``: its tower shapes).
    "mistral3": {"llm": {}, "vision": {}},
    # Llama 4's decoder behind the fixed tower, against HF's Llama 4 text model inside LlavaForConditionalGeneration
    # (``bench.llama4``: its decoder fields there; neva builds no Llama 4 tower yet).
    "llama4": {"llm": {}, "vision": {}},
}
NATIVE_FAMILIES = (
    "qwen2_5_vl",
    "qwen3_5",
    "glm4v",
)  # families whose images are native-resolution patches (``bench.qwen_vl``)
TILED_FAMILIES = ("internvl",)  # families whose images are their own tiles (``bench.internvl``)
ROW_FAMILIES = (
    "mistral3",
)  # families whose images are Pixtral's, rows of tokens closed by breaks (``bench.mistral3``)


def cpu_shapes(smoke: bool = False, family: str = "llama") -> dict[str, dict]:
    """The LLM and vision fields of the benchmark's model."""
    if family not in FAMILIES:
        raise SystemExit(f"--family {family!r}: choose one of {sorted(FAMILIES)}")
    llm, vision = (LLM_PRESETS["tiny"], VISION_PRESETS["tiny"]) if smoke else (CPU_LLM, CPU_VISION)
    return {"llm": {**llm, **FAMILIES[family]["llm"]}, "vision": {**vision, **FAMILIES[family]["vision"]}}


def cpu_model_config(
    smoke: bool = False, family: str = "llama", anyres: bool = False, video: bool = False
) -> NevaConfig:
    """The CPU benchmark's NeVA: 4-layer ViT (64 image tokens), 8-layer decoder of width 384, vocab 32000 (``smoke``:
    the tiny presets), of the given ``family`` (``FAMILIES``); ``anyres``: LLaVA-NeXT tiles on 1x1..2x2 grids
    (``spatial_unpad`` + ``image_newline``, what transformers' LlavaNext does); ``video``: LLaVA-NeXT-Video (AnyRes
    images, as its HF class lays them out, and videos: each frame's grid 2x2-average-pooled, a video token of its own
    just below the image token)."""
    import dataclasses

    from neva.models.anyres import AnyResConfig, parse_grid_pinpoints
    from neva.models.video import VideoConfig

    shapes = cpu_shapes(smoke, family)
    if family in ROW_FAMILIES:
        if anyres or video:
            raise SystemExit(f"--family {family}: images at their own size, not --anyres / --video")
        from bench.mistral3 import model_config as rows_config

        return rows_config(shapes["llm"], smoke)
    if family in NATIVE_FAMILIES:
        if anyres or video:
            raise SystemExit(f"--family {family}: native-resolution images, not --anyres / --video")
        if family == "glm4v":
            from bench.glm4v import model_config as glm4v_config

            return glm4v_config(shapes["llm"], smoke)
        from bench.qwen_vl import model_config

        return model_config(shapes["llm"], smoke, family)
    if family == "gemma3":
        if anyres or video:
            raise SystemExit("--family gemma3: fixed-size images, not --anyres / --video")
        from bench.gemma3 import model_config as gemma3_config

        return gemma3_config(shapes["llm"], shapes["vision"], smoke)
    if family == "llama4":
        if anyres or video:
            raise SystemExit("--family llama4: fixed-size images, not --anyres / --video")
        from bench.llama4 import model_config as llama4_config

        return llama4_config(shapes["llm"], shapes["vision"], smoke)
    if family in TILED_FAMILIES:
        if anyres or video:
            raise SystemExit(f"--family {family}: its own tiles, not --anyres / --video")
        from bench.internvl import model_config as tiled_config

        return tiled_config(shapes["llm"], smoke)
    cfg = build_config(llm=shapes["llm"], vision=shapes["vision"])
    if not (anyres or video):
        return cfg
    pins = parse_grid_pinpoints("(1x1),...,(2x2)", cfg.vision.image_size)
    cfg = dataclasses.replace(cfg, anyres=AnyResConfig(grid_pinpoints=pins))
    if not video:
        return cfg
    return dataclasses.replace(cfg, video=VideoConfig(), video_token_id=cfg.image_token_id - 1)


def stream_spec(cfg: NevaConfig, seed: int, smoke: bool = False, num_frames: int = 0) -> StreamSpec:
    """The benchmark's sample stream for ``cfg`` (videos of ``num_frames`` frames where the model takes video)."""
    pins = None if cfg.anyres is None else tuple(tuple(p) for p in cfg.anyres.grid_pinpoints)
    video = {}
    if cfg.video is not None:
        video = dict(num_frames=num_frames, video_tokens=cfg.video_tokens(num_frames), video_token_id=cfg.video_token)
    return StreamSpec(
        **video,
        grid_pinpoints=pins,
        vocab_size=cfg.llm.vocab_size,
        image_token_id=cfg.image_token_id,
        # A native tower's images get their own sizes and counts (``bench.qwen_vl.native_sample``) over the stream's.
        num_image_tokens=16 if cfg.vision.spec.patch_grid else cfg.num_image_tokens,
        image_size=cfg.vision.image_size,
        seed=seed,
        **(SMOKE_TEXT if smoke else {}),
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train_config(args: Any) -> TrainConfig:
    """The stage's training config with the benchmark's batching and optimizer (both sides use its optimizer)."""
    return stage_config(
        args.stage,
        f"model.data.packing={'true' if args.packing else 'false'}",
        f"model.micro_batch_size={args.batch_size}",
        f"model.global_batch_size={args.batch_size}",
        f"model.seed={args.seed}",
        f"model.optim.lr={args.lr}",
        "model.optim.weight_decay=0.0",
        "model.optim.betas=[0.9,0.95]",
        "model.optim.eps=1e-8",
    )


def native_shapes(cfg: NevaConfig) -> dict[str, dict]:
    """The LLM and tower fields of a native family's model, for the summary."""
    return {"llm": dataclasses.asdict(cfg.llm), "vision": dataclasses.asdict(cfg.vision)}


def _hf_part(name: str) -> str:
    if "vision_tower" in name:
        return "vision"
    if "multi_modal_projector" in name:
        return "projector"
    return "llm"


def _apply_policy_hf(model: torch.nn.Module, policy: TrainablePolicy) -> None:
    """``neva.models.trainable.apply_policy`` for HF's module names."""
    if policy.lora is not None:
        raise ValueError("the HF side has no LoRA adapters")
    for name, p in model.named_parameters():
        p.requires_grad_(getattr(policy, _hf_part(name)))


def _neva_side(args: Any, cfg: NevaConfig, batches: list[list[dict]]) -> tuple[Any, list[Any], list[int]]:
    """neva.train's step: Collator (packed or padded), Engine.forward_backward, clip, AdamW (foreach on CPU)."""
    from neva.data.collate import Collator
    from neva.training.optim import build_optimizer

    train_cfg = train_config(args)
    engine, _ = build_engine(cfg, train_cfg, torch.device("cpu"))
    engine.model.train()
    optimizer = build_optimizer(engine.named_trainable_parameters(), train_cfg.model.optim)
    data = train_cfg.model.data
    axes = 3 if cfg.llm.mrope_section is not None else 1  # an M-RoPE decoder's three position axes
    collate = Collator(PAD_ID, args.seq_length, data.pad_to_multiple_of, data.packing, axes)
    collated = [collate(b) for b in batches]

    def step(batch: dict) -> float:
        loss, _ = engine.forward_backward([batch])
        engine.clip_grad_norm(train_cfg.trainer.gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.after_optimizer_step()
        return float(loss)

    # Positions the decoder computes: packed rows that the engine joins lose their padding (MicroBatch.joined).
    computed = [int((b.joined() if engine.join_rows else b).input_ids.numel()) for b in collated]
    return step, collated, computed


def _hf_side(args: Any, cfg: NevaConfig, batches: list[list[dict]]) -> tuple[Any, list[Any], list[int]]:
    """A plain HF loop: padded batches, ``model(**batch).loss``, backward, clip, ``torch.optim.AdamW``."""
    import transformers

    from neva.checkpoint.hf_config import llava_config_dict
    from neva.checkpoint.hf_keys import MODULE_PREFIXES, neva_key_to_hf
    from neva.checkpoint.hf_moe import module_state
    from neva.checkpoint.hf_wrappers import wrapper_for

    train_cfg = train_config(args)
    if cfg.vision.spec.native_sizes is not None:
        return _hf_rows_side(cfg, train_cfg, batches)
    if cfg.vision.spec.patch_grid:
        return _hf_native_side(cfg, train_cfg, batches)
    if cfg.projector.type == "gemma3":
        return _hf_gemma3_side(cfg, train_cfg, batches)
    if cfg.vision.spec.tiles is not None:
        return _hf_tiled_side(cfg, train_cfg, batches)
    if cfg.llm.family == "llama4_text":
        return _hf_llama4_side(cfg, train_cfg, batches)
    wrapper = wrapper_for(cfg)  # LlavaNext with AnyRes, LlavaNextVideo with video
    hf_cfg = getattr(transformers, wrapper.config_class)(**llava_config_dict(cfg, pad_token_id=PAD_ID))
    hf_cfg._attn_implementation = "sdpa"
    model = getattr(transformers, wrapper.model_class)(hf_cfg)
    # neva's initial weights, made by the same path as neva's side (so both start bit-identical).
    neva = build_engine(cfg, train_cfg, torch.device("cpu"))[0].parts[0]
    state = module_state({neva_key_to_hf(k, MODULE_PREFIXES): v for k, v in neva.state_dict().items()})
    result = model.load_state_dict(state, strict=True)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"weight copy into HF failed: {result}")
    del neva, state
    gc.collect()
    _apply_policy_hf(model, train_cfg.model.trainable_policy())
    return _hf_loop(model, train_cfg, [collate_hf(b) for b in batches])


def _hf_native_side(cfg: NevaConfig, train_cfg: TrainConfig, batches: list[list[dict]]):
    """HF Qwen2_5_VLForConditionalGeneration (or the family's class: ``bench.glm4v``) from neva's initial weights,
    the stage's policy, the same loop."""
    from bench.qwen_vl import collate_hf_native, hf_model, hf_part

    if cfg.projector.type == "glm4v_merger":
        from bench.glm4v import hf_model, hf_part

    neva = build_engine(cfg, train_cfg, torch.device("cpu"))[0].parts[0]
    model = hf_model(cfg, neva.state_dict())
    del neva
    gc.collect()
    policy = train_cfg.model.trainable_policy()
    for name, p in model.named_parameters():
        p.requires_grad_(getattr(policy, hf_part(name)))
    return _hf_loop(model, train_cfg, [collate_hf_native(cfg, b) for b in batches])


def _hf_rows_side(cfg: NevaConfig, train_cfg: TrainConfig, batches: list[list[dict]]):
    """HF Mistral3ForConditionalGeneration from neva's initial weights, the stage's policy, the same loop."""
    from bench.mistral3 import collate_hf_pixtral, hf_model

    neva = build_engine(cfg, train_cfg, torch.device("cpu"))[0].parts[0]
    model = hf_model(cfg, neva.state_dict())
    del neva
    gc.collect()
    _apply_policy_hf(model, train_cfg.model.trainable_policy())
    return _hf_loop(model, train_cfg, [collate_hf_pixtral(cfg, b) for b in batches])


def _hf_gemma3_side(cfg: NevaConfig, train_cfg: TrainConfig, batches: list[list[dict]]):
    """HF Gemma3ForConditionalGeneration from neva's initial weights, the stage's policy, the same loop; its batches
    carry ``token_type_ids`` (1 at image tokens), as Gemma3Processor's do."""
    from bench.gemma3 import hf_model, hf_part

    neva = build_engine(cfg, train_cfg, torch.device("cpu"))[0].parts[0]
    model = hf_model(cfg, neva.state_dict())
    del neva
    gc.collect()
    policy = train_cfg.model.trainable_policy()
    for name, p in model.named_parameters():
        p.requires_grad_(getattr(policy, hf_part(name)))
    collated = [collate_hf(b) for b in batches]
    for batch in collated:
        batch["token_type_ids"] = (batch["input_ids"] == cfg.image_token_id).long()
    return _hf_loop(model, train_cfg, collated)


def _hf_tiled_side(cfg: NevaConfig, train_cfg: TrainConfig, batches: list[list[dict]]):
    """HF InternVLForConditionalGeneration from neva's initial weights, the stage's policy, the same loop."""
    from bench.internvl import collate_hf_tiled, hf_model

    neva = build_engine(cfg, train_cfg, torch.device("cpu"))[0].parts[0]
    model = hf_model(cfg, neva.state_dict())
    del neva
    gc.collect()
    _apply_policy_hf(model, train_cfg.model.trainable_policy())
    return _hf_loop(model, train_cfg, [collate_hf_tiled(cfg, b) for b in batches])


def _hf_llama4_side(cfg: NevaConfig, train_cfg: TrainConfig, batches: list[list[dict]]):
    """HF LlavaForConditionalGeneration with HF's Llama 4 text model, from neva's initial weights, the same loop."""
    from bench.llama4 import hf_model

    neva = build_engine(cfg, train_cfg, torch.device("cpu"))[0].parts[0]
    model = hf_model(cfg, neva.state_dict())
    del neva
    gc.collect()
    _apply_policy_hf(model, train_cfg.model.trainable_policy())
    return _hf_loop(model, train_cfg, [collate_hf(b) for b in batches])


def _hf_loop(model: torch.nn.Module, train_cfg: TrainConfig, collated: list[dict]):
    """The plain HF loop's step over ``collated`` batches: loss, backward, clip, ``torch.optim.AdamW``."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optim = train_cfg.model.optim
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
    )

    def step(batch: dict) -> float:
        loss = model(**batch).loss
        loss.backward()
        if train_cfg.trainer.gradient_clip_val > 0:  # 0 = no clipping (a 0 norm bound would erase the gradients)
            torch.nn.utils.clip_grad_norm_(params, train_cfg.trainer.gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, collated, [int(b["input_ids"].numel()) for b in collated]


def run_side(side: str, args: Any) -> dict[str, Any]:
    """Train ``side`` (``neva`` or ``hf``) for warm-up + measured steps in this process; timings, losses, memory.

    In lockstep mode (the parent's default) the child prints ``{"ready": true}`` after setup, then runs one step per
    ``step`` line read from stdin and answers each with its time and loss; the summary follows a ``done`` line. The
    parent alternates the two sides step by step, so background load on a shared machine hits both alike.
    """
    # Import the HF model code on both sides so that the baseline resident memory is comparable.
    import transformers.models.llava.modeling_llava  # noqa: F401

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = cpu_model_config(args.smoke, args.family, args.anyres, args.video)
    spec = stream_spec(cfg, args.seed, args.smoke, args.num_frames)
    batches = make_batches(spec, args.batch_size, args.warmup + args.steps)
    if cfg.vision.spec.native_sizes is not None:
        from bench.mistral3 import pixtral_sample

        batches = [[pixtral_sample(cfg, s, s["id"], args.seed) for s in b] for b in batches]
    elif cfg.vision.spec.patch_grid:
        from bench.qwen_vl import native_sample

        batches = [[native_sample(cfg, s, s["id"], args.seed) for s in b] for b in batches]
    elif cfg.vision.spec.tiles is not None:
        from bench.internvl import tiled_sample

        batches = [[tiled_sample(cfg, s, s["id"], args.seed) for s in b] for b in batches]
    gc.collect()
    baseline = _rss_bytes()
    build = _neva_side if side == "neva" else _hf_side
    t0 = time.perf_counter()
    step, collated, computed = build(args, cfg, batches)
    build_s = time.perf_counter() - t0
    if args.lockstep:
        _say({"ready": True})
    times, cpu_times, losses = [], [], []
    for batch in collated:
        if args.lockstep and sys.stdin.readline().strip() != "step":
            raise RuntimeError("lockstep protocol: expected 'step'")
        t, c = time.perf_counter(), time.process_time()
        losses.append(step(batch))
        times.append(time.perf_counter() - t)
        # CPU seconds of all threads: on a shared, oversubscribed machine this tracks the work done more steadily
        # than wall time (which also counts the time other processes held the cores).
        cpu_times.append(time.process_time() - c)
        if args.lockstep:
            _say({"t": times[-1], "cpu": cpu_times[-1], "loss": losses[-1]})
    if args.lockstep and sys.stdin.readline().strip() != "done":
        raise RuntimeError("lockstep protocol: expected 'done'")
    med = statistics.median(times[args.warmup :])
    return {
        "side": side,
        "packing": bool(args.packing) if side == "neva" else False,
        "threads": torch.get_num_threads(),
        "build_s": build_s,
        "step_s": times,
        "median_step_s": med,
        "cpu_s": cpu_times,
        "median_cpu_s": statistics.median(cpu_times[args.warmup :]),
        "computed_tokens": computed,
        "samples_per_sec": args.batch_size / med,
        "real_tokens_per_step": statistics.mean(real_tokens(b) for b in batches),
        "computed_tokens_per_step": statistics.mean(computed),
        "tokens_per_sec": statistics.mean(real_tokens(b) for b in batches[args.warmup :]) / med,
        "losses": losses,
        "peak_mb": (_peak_rss_bytes() - baseline) / 2**20,
        "peak_rss_mb": _peak_rss_bytes() / 2**20,
        "baseline_rss_mb": baseline / 2**20,
    }


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _child_cmd(side: str, args: Any, packing: bool) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(sys.argv[0]),
        "--device",
        "cpu",
        "--child",
        side,
        "--lockstep",
        "--stage",
        args.stage,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--seq-length",
        str(args.seq_length),
        "--lr",
        str(args.lr),
        "--seed",
        str(args.seed),
        "--threads",
        str(args.threads),
        "--packing" if packing else "--no-packing",
        *(["--smoke"] if args.smoke else []),
        "--family",
        args.family,
        *(["--anyres"] if args.anyres else []),
        *(["--video", "--num-frames", str(args.num_frames)] if args.video else []),
    ]


class _Child:
    """One side in its own process, driven step by step over pipes."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{self.name} child exited with code {self.proc.returncode} (its stderr is above)")
        return json.loads(line)

    def wait_ready(self) -> None:
        if not self._read().get("ready"):
            raise RuntimeError(f"{self.name} child did not report ready")

    def step(self) -> dict[str, Any]:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._read()

    def finish(self) -> dict[str, Any]:
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        result = self._read()
        self.proc.wait()
        return result


def _run_children(named_cmds: list[tuple[str, list[str]]], n_steps: int) -> dict[str, dict[str, Any]]:
    children = [_Child(name, cmd) for name, cmd in named_cmds]
    try:
        for child in children:  # set up one after the other: model building is not measured anyway
            child.wait_ready()
        for i in range(n_steps):
            # Rotate who goes first, so a side never always follows the same neighbour.
            order = children[i % len(children) :] + children[: i % len(children)]
            for child in order:
                r = child.step()
                print(
                    f"  step {i}: {child.name:<8} wall {r['t']:7.3f} s  cpu {r['cpu']:7.3f} s  loss {r['loss']:.5f}",
                    file=sys.stderr,
                    flush=True,
                )
        return {child.name: child.finish() for child in children}
    finally:
        for child in children:
            if child.proc.poll() is None:
                child.proc.kill()


def _paired_ratio(hf: list[float], neva: list[float], warmup: int) -> float:
    """Median over the measured steps of HF's seconds / neva's on the same batch: the ratio of the sides' medians
    can pair two different batches, and HF's time per batch swings more than the batch's size (its allocations)."""
    return statistics.median(h / n for h, n in zip(hf[warmup:], neva[warmup:]))


def _row(name: str, r: dict[str, Any], base: dict[str, Any]) -> str:
    return (
        f"| {name:<22} | {r['samples_per_sec']:8.2f} | {r['tokens_per_sec']:9.0f} | {r['computed_tokens_per_step']:8.0f} "
        f"| {r['median_step_s']:7.3f} | {r['peak_mb']:8.0f} | {r['samples_per_sec'] / base['samples_per_sec']:5.2f}x |"
    )


def run_cpu(args: Any) -> dict[str, Any]:
    """Run the sides in child processes, print the table, return the summary (printed as JSON by the caller)."""
    cfg = cpu_model_config(args.smoke, args.family, args.anyres, args.video)
    spec = stream_spec(cfg, args.seed, args.smoke, args.num_frames)
    sides: list[tuple[str, dict[str, Any]]] = []
    print(
        f"# CPU benchmark: stage={args.stage}, {args.batch_size} samples/step, {args.warmup} warm-up + {args.steps} steps",
        flush=True,
    )
    if cfg.video is not None:
        print(
            f"# video: {spec.num_frames} frames x {spec.video_tokens // spec.num_frames} tokens = {spec.video_tokens} "
            f"positions per video; {spec.video_fraction:.0%} of the visual samples are videos",
            flush=True,
        )
    cmds = [("hf", _child_cmd("hf", args, False)), ("neva", _child_cmd("neva", args, args.packing))]
    if args.compare_padding:
        cmds.append(("neva_alt", _child_cmd("neva", args, not args.packing)))
    results = _run_children(cmds, args.warmup + args.steps)
    hf, neva, extra = results["hf"], results["neva"], results.get("neva_alt")
    sides.append(("hf (padded, AdamW)", hf))
    sides.append((f"neva ({'packed' if args.packing else 'padded'})", neva))
    if extra is not None:
        sides.append((f"neva ({'padded' if args.packing else 'packed'})", extra))
    print()
    print("| side                   | sample/s |  tokens/s | tok/step | step s  |  peak MB | speed |")
    print("|------------------------|----------|-----------|----------|---------|----------|-------|")
    for name, r in sides:
        print(_row(name, r, hf))
    loss_rel = abs(neva["losses"][0] - hf["losses"][0]) / abs(hf["losses"][0])
    print(
        f"\nfirst-step loss: neva {neva['losses'][0]:.6f}  hf {hf['losses'][0]:.6f}  (rel. diff {loss_rel:.1e}); "
        f"last: neva {neva['losses'][-1]:.6f}  hf {hf['losses'][-1]:.6f}"
    )
    print(
        f"real tokens/step {hf['real_tokens_per_step']:.0f}; peak MB = max RSS - RSS before the model was built; "
        f"median CPU seconds/step: hf {hf['median_cpu_s']:.2f}, neva {neva['median_cpu_s']:.2f} "
        f"({hf['median_cpu_s'] / neva['median_cpu_s']:.2f}x)"
    )
    paired = {key: _paired_ratio(hf[key], neva[key], args.warmup) for key in ("step_s", "cpu_s")}
    print(
        f"median of the per-step ratios (the same batch on both sides): wall {paired['step_s']:.2f}x, "
        f"CPU {paired['cpu_s']:.2f}x"
    )
    own_shapes = cfg.vision.spec.patch_grid or cfg.vision.spec.tiles is not None  # a family's own shapes
    summary = {
        "mode": "cpu",
        "stage": args.stage,
        "neva_samples_per_sec": round(neva["samples_per_sec"], 4),
        "hf_samples_per_sec": round(hf["samples_per_sec"], 4),
        "speedup_vs_hf": round(neva["samples_per_sec"] / hf["samples_per_sec"], 4),
        "speedup_cpu_time": round(hf["median_cpu_s"] / neva["median_cpu_s"], 4),
        "speedup_per_step_median": round(paired["step_s"], 4),
        "speedup_cpu_per_step_median": round(paired["cpu_s"], 4),
        "neva_peak_mb": round(neva["peak_mb"], 1),
        "hf_peak_mb": round(hf["peak_mb"], 1),
        "neva_packing": bool(args.packing),
        "first_loss_rel_diff": loss_rel,
        "neva_first_loss": neva["losses"][0],
        "hf_first_loss": hf["losses"][0],
        "neva_tokens_per_step": neva["computed_tokens_per_step"],
        "hf_tokens_per_step": hf["computed_tokens_per_step"],
        "real_tokens_per_step": hf["real_tokens_per_step"],
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": hf["threads"],
        "smoke": bool(args.smoke),
        "family": args.family,
        "anyres": cfg.anyres is not None,
        "video": cfg.video is not None,
        "seq_length": args.seq_length,
        "model": {
            # a native family's own shapes (``bench.qwen_vl``), not the fixed-tower ones it replaces
            **(native_shapes(cfg) if own_shapes else cpu_shapes(args.smoke, args.family)),
            "image_tokens": None if cfg.vision.spec.patch_grid else cfg.num_image_tokens,
            **({"video_tokens": spec.video_tokens, "num_frames": spec.num_frames} if cfg.video is not None else {}),
        },
        "stream": asdict(spec),
    }
    if extra is not None:
        summary["neva_alt_samples_per_sec"] = round(extra["samples_per_sec"], 4)
        summary["neva_alt_peak_mb"] = round(extra["peak_mb"], 1)
        summary["neva_alt_tokens_per_step"] = extra["computed_tokens_per_step"]
        packed, padded = (neva, extra) if args.packing else (extra, neva)
        summary["packed_vs_padded"] = round(packed["samples_per_sec"] / padded["samples_per_sec"], 4)
    return summary
