"""Token-budget mode (``--token-budget``): padding and peak memory of fixed micro-batches against micro-batches filled
to a token budget (``model.data.max_tokens_per_micro_batch``), the same global batches.

A generated LLaVA-format set (``--tb-samples`` records under a temporary folder: text-only, one- and two-image
records and 8-frame videos, replies of log-uniform length, so one sample can be ~20× another) trains ``--steps``
optimizer steps after ``--warmup`` of the pretraining stage (the projector trains; the decoder's activations are kept
for its input gradients) of a tiny-CLIP, width-256, 4-layer Llama at rows of ``--tb-seq`` tokens, fp32, one process
per side, one thread:

- ``fixed``: ``model.micro_batch_size=--tb-micro`` samples per micro-batch, right-padded (``pad_to_multiple_of`` 16);
- ``budget``: the same global batch (``--tb-micro × --tb-accum`` samples) in micro-batches of at most ``--tb-budget``
  padded tokens.

``fixed_packed`` / ``budget_packed``: the same with ``model.data.packing=true`` (the budget then counts real tokens).

Reported per side: the padding share of the collated rows (``pad rows``: padding positions over all positions, the
``pad_to_multiple`` rounding included; what a CUDA run's FlexAttention processes) and of what the decoder ran here
(``pad run``: on the CPU packed rows are joined to their real tokens, ``neva.data.micro_batch.MicroBatch.joined``), micro-batches per step, the process's peak RSS above its state before the first step (MB: the
steps' activations and gradients, the warm-up's included), step seconds (median) and the losses, which must agree (the same steps).
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = [
    "red",
    "green",
    "blue",
    "small",
    "large",
    "left",
    "right",
    "top",
    "bottom",
    "shape",
    "circle",
    "square",
    "image",
    "shows",
    "there",
    "is",
    "a",
    "the",
    "of",
]


def write_set(directory: Path, n: int, seed: int = 0) -> Path:
    """``n`` records (one in 4 text-only, one in 8 a video, one in 8 two images) with their images and videos."""
    import av
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    media = directory / "media"
    media.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        kind = "text" if i % 4 == 0 else "video" if i % 8 == 1 else "two" if i % 8 == 3 else "image"
        words = int(math.exp(rng.uniform(math.log(8), math.log(300))))  # ~30 to ~1300 tokens of text
        reply = " ".join(rng.choice(WORDS) for _ in range(words))
        question = "Describe it."
        record: dict[str, Any] = {"id": f"s{i}"}
        pixels = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        if kind == "video":
            name = f"v{i}.mp4"
            with av.open(str(media / name), "w") as container:
                stream = container.add_stream("libx264", rate=10)
                stream.width = stream.height = 32
                stream.pix_fmt = "yuv420p"
                for t in range(10):
                    frame = av.VideoFrame.from_ndarray(np.roll(pixels, t, axis=1), format="rgb24")
                    container.mux(stream.encode(frame))
                container.mux(stream.encode())
            record["video"], question = name, "<video>\n" + question
        elif kind != "text":
            names = [f"i{i}_{k}.png" for k in range(2 if kind == "two" else 1)]
            for name in names:
                Image.fromarray(pixels).save(media / name)
            record["image"] = names[0] if len(names) == 1 else names
            question = "<image>\n" * len(names) + question
        record["conversations"] = [{"from": "human", "value": question}, {"from": "gpt", "value": reply}]
        records.append(record)
    path = directory / "data.json"
    path.write_text(json.dumps(records))
    return path


SIDES = ("fixed", "budget", "fixed_packed", "budget_packed")


def overrides(args: Any, data: Path, side: str) -> list[str]:
    seq = args.tb_seq
    return [
        "+stage=pretrain",
        "data=llava",
        f"model.data.data_path={data / 'data.json'}",
        f"model.data.image_folder={data / 'media'}",
        "model.data.num_workers=0",
        "model.data.pad_to_multiple_of=16",
        f"model.data.seq_length={seq}",
        "model.data.num_frames=8",
        "model.mm_cfg.mm_spatial_pool_stride=1",
        f"++model.mm_cfg.llm.arch_overrides={{hidden_size:256,intermediate_size:704,num_layers:4,max_seq_len:{seq}}}",
        f"model.micro_batch_size={args.tb_micro}",
        f"model.global_batch_size={args.tb_micro * args.tb_accum}",
        f"model.seed={args.seed}",
        f"model.data.packing={str(side.endswith('packed')).lower()}",
        *([f"model.data.max_tokens_per_micro_batch={args.tb_budget}"] if side.startswith("budget") else []),
    ]


def run_side(side: str, args: Any, data: Path) -> dict[str, Any]:
    """One side's steps in this process (the child)."""
    import torch

    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.module import NevaModule, StepBatches
    from neva.training.optim import build_optimizer
    from neva.training.run import data_module_type

    torch.set_num_threads(1)
    cfg = compose_config(overrides(args, data, side))
    layout = resolve_layout(cfg)
    source = resolve_source(cfg)
    dm = data_module_type(cfg)(
        cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=cfg.model.micro_batch_size,
        seed=cfg.model.seed, accumulation=layout.grad_accum,
    )  # fmt: skip
    dm.setup("fit")
    module = NevaModule(cfg, source, dm, layout)
    module.configure_model()
    engine = module.engine
    optimizer = build_optimizer(engine.named_trainable_parameters(), cfg.model.optim)
    steps = list(StepBatches(dm, layout.grad_accum))[: args.warmup + args.steps]
    real = positions = ran = 0
    losses, seconds, counts = [], [], []
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the model, optimizer and data built; no step yet
    for i, micro_batches in enumerate(steps):
        start = time.perf_counter()
        loss, _, _ = engine.optimizer_step(optimizer, micro_batches, clip=1.0, step=i)
        losses.append(loss.item())
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
            counts.append(len(micro_batches))
            for mb in micro_batches:
                n = int((mb.segment_ids > 0).sum())
                real += n
                positions += mb.input_ids.numel()
                ran += n if engine.join_rows else mb.input_ids.numel()  # packed rows joined: real tokens only
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "side": side,
        "padding_share_rows": 1 - real / positions,
        "padding_share_run": 1 - real / ran,
        "micro_batches_per_step": counts,
        "peak_rss_above_start_mb": (peak - base) / 1024,
        "step_s_median": statistics.median(seconds),
        "losses": losses,
    }


def run_token_budget(args: Any, script: str) -> dict[str, Any]:
    """Both sides, each in a child process of its own; the summary."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        write_set(data, args.tb_samples, args.seed)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        sides = []
        for side in SIDES:
            cmd = [sys.executable, script, "--token-budget-child", f"{side}:{data}", *sys.argv[1:]]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            sides.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'side':14} {'pad rows':>8} {'pad run':>8} {'micro-batches/step':>20} {'peak MB':>9} {'step s':>7}")
    for s in sides:
        print(f"{s['side']:14} {s['padding_share_rows']:8.1%} {s['padding_share_run']:8.1%} "
              f"{s['micro_batches_per_step']!s:>20} {s['peak_rss_above_start_mb']:9.0f} {s['step_s_median']:7.2f}")  # fmt: skip
    diff = max(abs(a - b) / abs(b) for s in sides[1:] for a, b in zip(s["losses"], sides[0]["losses"]))
    print(f"largest relative loss difference to fixed: {diff:.1e}")
    return {"mode": "token_budget", "sides": sides, "loss_rel_diff": diff,
            "args": {k: getattr(args, k) for k in ("tb_samples", "tb_seq", "tb_micro", "tb_accum", "tb_budget",
                                                    "steps", "warmup", "seed")}}  # fmt: skip
