"""Input-pipeline benchmark: decoded-and-preprocessed images/s of one loader worker, neva against HF.

The same JPEG files (generated here: photo-like content at COCO-like sizes) go through

* ``neva``: what a neva loader worker does per image — read the file (regular files only), decode it with the pixel
  cap, resize + crop to uint8 (``neva.data.images``); normalisation runs later on the device;
* ``neva+cpu_norm``: the same plus the fp32 normalisation on the CPU (what a worker would pay without the device
  step);
* ``hf``: ``PIL.Image.open`` + ``transformers.CLIPImageProcessor`` (float32, normalised) per image, as an HF
  dataset's ``__getitem__`` calls it.

One process, one torch thread (what a DataLoader worker gets), rates per CPU second. From the per-worker rate it derives the workers one
GPU and a DGX node (8 GPUs) need at the issue's per-GPU sample rates.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# samples/s per GPU the issue asks of one H200, and images per sample (LLaVA-1.5's finetune mix: 41K of 665K
# samples are text-only).
TARGETS = {
    "13b-pretrain-224": (224, 20.0, 1.0),
    "7b-finetune-224": (224, 15.0, 624 / 665),
    "13b-pretrain-336": (336, 20.0, 1.0),
    "7b-finetune-336": (336, 15.0, 624 / 665),
}
GPUS_PER_NODE = 8
SIZES = [(640, 480), (500, 375), (480, 640), (640, 427), (612, 612), (800, 600)]


def write_jpegs(directory: Path, n: int, seed: int) -> list[Path]:
    """``n`` JPEGs (quality 90) of smooth gradients plus texture, so sizes and decode cost resemble photos."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([xx / w, yy / h, (xx + yy) / (w + h)], axis=-1) * rng.uniform(120, 255, 3)
        texture = rng.normal(0, 18, (h, w, 3))
        arr = np.clip(base + texture, 0, 255).astype(np.uint8)
        path = directory / f"img{i:04d}.jpg"
        Image.fromarray(arr).save(path, quality=90)
        paths.append(path)
    return paths


def _neva(size: int, normalise: bool):
    import torch

    from neva.data.images import ImageProcessor, decode_image, read_regular_file
    from neva.models.config import VisionConfig
    from neva.models.vision import normalize_pixels

    vision = VisionConfig(image_size=size, patch_size=14)
    processor = ImageProcessor(vision, "square")  # HF's recipe: resize the short side, centre crop

    def one(path: Path) -> Any:
        pixels = processor(decode_image(read_regular_file(str(path), path.name), path.name))
        if normalise:
            pixels = normalize_pixels(pixels[None], vision.image_mean, vision.image_std)
        return pixels

    torch.set_num_threads(1)
    return one


def _hf(size: int):
    from PIL import Image
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})

    def one(path: Path) -> Any:
        with Image.open(path) as img:
            return processor(img.convert("RGB"), return_tensors="pt")["pixel_values"]

    return one, type(processor).__name__


def _rate(fn, paths: list[Path], repeats: int) -> float:
    """Median images per CPU second over ``repeats`` passes (after a short warm-up).

    CPU time of this process, not wall time: a worker is one single-threaded process, so this is its rate when it
    has a core, and it does not drift with other load on a shared machine (wall time is printed beside it)."""
    for p in paths[:4]:
        fn(p)
    rates = []
    for _ in range(repeats):
        start = time.process_time()
        for p in paths:
            fn(p)
        rates.append(len(paths) / (time.process_time() - start))
    return statistics.median(rates)


def run_input_pipeline(args: Any) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    n, repeats = args.images, args.repeats
    rates: dict[int, dict[str, float]] = {}
    hf_name = ""
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_jpegs(Path(tmp), n, args.seed)
        mean_kb = sum(p.stat().st_size for p in paths) / len(paths) / 1024
        for size in sorted({s for s, _, _ in TARGETS.values()}):
            hf, hf_name = _hf(size)
            rates[size] = {
                "neva": _rate(_neva(size, normalise=False), paths, repeats),
                "neva+cpu_norm": _rate(_neva(size, normalise=True), paths, repeats),
                "hf": _rate(hf, paths, repeats),
            }
    print(f"{n} JPEGs (mean {mean_kb:.0f} KiB, {len(SIZES)} sizes up to 800x600), 1 process, 1 torch thread, "
          f"images per CPU second, median of {repeats} passes; HF = {hf_name}")  # fmt: skip
    print(f"{'px':>4} {'neva img/s':>11} {'neva+cpu_norm':>14} {'hf img/s':>9} {'neva/hf':>8}")
    for size, r in rates.items():
        print(f"{size:>4} {r['neva']:>11.1f} {r['neva+cpu_norm']:>14.1f} {r['hf']:>9.1f} {r['neva'] / r['hf']:>7.2f}x")
    needs = {}
    print(
        f"\n{'case':<18} {'samples/s/GPU':>13} {'img/s/GPU':>10} {'workers/GPU':>12} {'workers/node':>13} {'(hf)':>6}"
    )
    for case, (size, per_gpu, images_per_sample) in TARGETS.items():
        images = per_gpu * images_per_sample
        workers = math.ceil(images / rates[size]["neva"])
        workers_hf = math.ceil(images / rates[size]["hf"])
        needs[case] = {
            "samples_per_s_per_gpu": per_gpu,
            "images_per_s_per_gpu": round(images, 2),
            "workers_per_gpu": workers,
            "workers_per_node": workers * GPUS_PER_NODE,
            "workers_per_node_hf": workers_hf * GPUS_PER_NODE,
        }
        print(f"{case:<18} {per_gpu:>13.1f} {images:>10.1f} {workers:>12} {workers * GPUS_PER_NODE:>13} "
              f"{workers_hf * GPUS_PER_NODE:>6}")  # fmt: skip
    return {
        "mode": "input_pipeline",
        "images": n,
        "repeats": repeats,
        "mean_jpeg_kib": round(mean_kb, 1),
        "cpu": os.cpu_count(),
        "hf_processor": hf_name,
        "images_per_s_per_worker": {str(s): {k: round(v, 1) for k, v in r.items()} for s, r in rates.items()},
        "workers": needs,
    }
