"""Video input-pipeline benchmark: sampled frames/s of one loader worker, neva's decode against PyAV's plain loop.

The same H.264 mp4 files (generated here: moving gradients plus texture, ``--video-seconds`` at 30 frames/s, a key
frame every 2 s, 640×360 like much of LLaVA-Video-178K) go through

* ``neva``: what a neva loader worker does per video — open the regular file, read the header (caps), sample
  ``num_frames`` indices (LLaVA-NeXT-Video's linspace), seek + decode forward to each, fit each frame to the tower
  (``neva.data.video.VideoSource``: load + pixels);
* ``plain``: PyAV's straightforward loop — decode every frame in order, keep the sampled ones (``to_image``), and the
  same tower fit.

Both sides must give the same tower inputs, pixel for pixel (checked first). One process, one decoder thread and one torch thread (what a DataLoader worker gets), rates per CPU second (medians
of ``--repeats`` passes; wall time drifts with other load on a shared machine). From the per-worker rate it derives
the workers one GPU and a DGX node (8 GPUs) need: frames per second per GPU (samples/s × num_frames) divided by
frames per second per worker.
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

GPUS_PER_NODE = 8
RATE = 30
WIDTH, HEIGHT = 640, 360


def write_mp4s(directory: Path, n: int, seconds: float, seed: int) -> list[Path]:
    """``n`` H.264 mp4 files of ``seconds`` s: a drifting gradient with noise, so decode cost resembles footage."""
    import av

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    paths = []
    for i in range(n):
        path = directory / f"clip{i:03d}.mp4"
        colour = rng.uniform(80, 255, 3)
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264", rate=RATE)
            stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
            stream.codec_context.gop_size = 2 * RATE
            stream.options = {"preset": "veryfast", "crf": "23"}
            for t in range(int(seconds * RATE)):
                shift = t * 4.0
                base = np.stack([(xx + shift) % WIDTH / WIDTH, yy / HEIGHT, ((xx + yy + shift) % 255) / 255], -1)
                arr = np.clip(base * colour + rng.normal(0, 12, (HEIGHT, WIDTH, 3)), 0, 255).astype(np.uint8)
                container.mux(stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")))
            container.mux(stream.encode())
        paths.append(path)
    return paths


def _neva(folder: Path, num_frames: int, size: int):
    from neva.data.video import VideoSource
    from neva.data.video_decode import VideoLimits
    from neva.models.config import VisionConfig

    source = VideoSource(str(folder), VideoLimits(num_frames), VisionConfig(image_size=size, patch_size=14))

    def one(path: Path) -> Any:
        return source.pixels(source.load(path.name))

    return one


def _plain(num_frames: int, size: int):
    import av
    import torch

    from neva.data.images import ImageProcessor
    from neva.models.config import VisionConfig

    fit = ImageProcessor(VisionConfig(image_size=size, patch_size=14), "square")

    def one(path: Path) -> Any:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.codec_context.thread_count = 1
            wanted = np.linspace(0, stream.frames - 1, num_frames, dtype=int).tolist()
            kept = {}
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    kept[i] = frame.to_image()
        return torch.stack([fit(kept[i]) for i in wanted])

    return one


def _rate(fn, paths: list[Path], repeats: int) -> tuple[float, float]:
    """Median sampled frames per CPU second and per wall second over ``repeats`` passes (after one warm-up video)."""
    fn(paths[0])
    cpu, wall = [], []
    for _ in range(repeats):
        start, start_wall, frames = time.process_time(), time.perf_counter(), 0
        for p in paths:
            frames += fn(p).shape[0]
        cpu.append(frames / (time.process_time() - start))
        wall.append(frames / (time.perf_counter() - start_wall))
    return statistics.median(cpu), statistics.median(wall)


def run_video_pipeline(args: Any) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    n, repeats, num_frames, size = args.videos, args.repeats, args.num_frames, args.video_size
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_mp4s(Path(tmp), n, args.video_seconds, args.seed)
        mean_kib = sum(p.stat().st_size for p in paths) / len(paths) / 1024
        neva, plain = _neva(Path(tmp), num_frames, size), _plain(num_frames, size)
        # the same work: both sides give the same tower inputs, pixel for pixel
        same = all(torch.equal(neva(p), plain(p)) for p in paths)
        if not same:
            raise SystemExit("neva's frames differ from the plain loop's: the comparison would be meaningless")
        rates = {"neva": _rate(neva, paths, repeats), "plain": _rate(plain, paths, repeats)}
    frames_total = int(args.video_seconds * RATE)
    print(f"{n} H.264 mp4 ({WIDTH}x{HEIGHT}, {frames_total} frames at {RATE} fps, key frame every 2 s, mean "
          f"{mean_kib:.0f} KiB), {num_frames} frames sampled per video, fit to {size} px; 1 process, 1 decoder "
          f"thread; sampled frames per CPU second (wall beside), median of {repeats} passes")  # fmt: skip
    print(f"{'side':<6} {'frames/s cpu':>13} {'frames/s wall':>14}")
    for side, (cpu, wall) in rates.items():
        print(f"{side:<6} {cpu:>13.1f} {wall:>14.1f}")
    speedup = rates["neva"][0] / rates["plain"][0]
    per_gpu = args.video_samples_per_gpu * num_frames
    workers = {side: math.ceil(per_gpu / cpu) for side, (cpu, _) in rates.items()}
    print(f"neva / plain: {speedup:.2f}x")
    print(f"\nat {args.video_samples_per_gpu:g} video samples/s per GPU = {per_gpu:g} frames/s per GPU: "
          f"{workers['neva']} workers per GPU, {workers['neva'] * GPUS_PER_NODE} per {GPUS_PER_NODE}-GPU node "
          f"(plain loop: {workers['plain']}, {workers['plain'] * GPUS_PER_NODE})")  # fmt: skip
    return {
        "mode": "video_pipeline",
        "videos": n,
        "frames_per_video": frames_total,
        "num_frames": num_frames,
        "image_size": size,
        "repeats": repeats,
        "mean_mp4_kib": round(mean_kib, 1),
        "cpu": os.cpu_count(),
        "same_pixels": same,
        "frames_per_s_per_worker": {side: round(cpu, 1) for side, (cpu, _) in rates.items()},
        "frames_per_wall_s": {side: round(wall, 1) for side, (_, wall) in rates.items()},
        "neva_over_plain": round(speedup, 2),
        "samples_per_s_per_gpu": args.video_samples_per_gpu,
        "workers_per_gpu": workers["neva"],
        "workers_per_node": workers["neva"] * GPUS_PER_NODE,
        "workers_per_node_plain": workers["plain"] * GPUS_PER_NODE,
    }
