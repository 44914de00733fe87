"""GPU check of Qwen3.5's linear attention (``scripts/gpu_check.sh``'s ``linear_attention`` line): neva's own chunked
delta rule against ``flash-linear-attention``'s kernel on the same inputs — outputs, final states and input gradients
(relative errors), and the forward + backward time of each — on packed rows (8 samples of random lengths in each of
2 rows of 8192) at a Qwen3.5 layer's shape (16 key heads serving 32 value heads of 128, bf16 inputs). Without
``fla`` installed the kernel's fields are null and the line says so; ``--tiny`` runs it on the CPU with tiny shapes.

    python scripts/bench/linear_attention.py [--tiny]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from neva.models.delta_rule import CHUNK, fla_kernel, gated_delta_rule
from neva.models.packed_rows import PackedRows


def inputs(tiny: bool, device: torch.device, seed: int = 0):
    """Packed rows' q, k, v, g, beta in the chunk-aligned layout (``PackedRows``) and its resets."""
    rows, length, samples = (2, 256, 3) if tiny else (2, 8192, 8)
    hk, hv, dk, dv = (2, 4, 32, 32) if tiny else (16, 32, 128, 128)
    gen = torch.Generator().manual_seed(seed)
    segments = []
    for _ in range(rows):
        cuts = sorted(torch.randperm(length - 1, generator=gen)[: samples - 1].add(1).tolist())
        bounds = [0, *cuts, length]
        segments.append(torch.cat([torch.full((e - s,), i + 1) for i, (s, e) in enumerate(itertools.pairwise(bounds))]))
    packed = PackedRows.of(torch.stack(segments), 4, device)
    dtype = torch.float32 if tiny else torch.bfloat16
    q, k = (torch.randn(rows, length, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(rows, length, hv, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(rows, length, hv, generator=gen))
    beta = torch.rand(rows, length, hv, generator=gen)
    laid = [packed.split(t.to(device)) for t in (q, k, v, g, beta)]
    laid = [t.to(dtype) if i < 3 else t for i, t in enumerate(laid)]
    return [t.requires_grad_() for t in laid], packed.resets


def run(tensors, resets, use_kernel: bool, reps: int) -> tuple[list[torch.Tensor], list[float]]:
    """Outputs, final state and input gradients of one forward + backward, and each repetition's seconds."""
    times, result = [], []
    for _ in range(reps):
        for t in tensors:
            t.grad = None
        if tensors[0].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out, state = gated_delta_rule(*tensors, use_kernel=use_kernel, resets=resets)
        out.float().square().sum().backward()
        if tensors[0].is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        result = [out.detach().float(), state.detach(), *(t.grad.float() for t in tensors)]
    return result, times


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    tensors, resets = inputs(args.tiny, device)
    line = {"check": "linear_attention", "device": str(device), "laid_out_tokens": int(resets.numel() * CHUNK)}
    fallback, fallback_s = run(tensors, resets, use_kernel=False, reps=args.reps)
    line["fallback_s"] = statistics.median(fallback_s)
    kernel = fla_kernel() if device.type == "cuda" else None
    line["kernel"] = None if kernel is None else getattr(sys.modules.get("fla"), "__version__", "installed")
    if kernel is None:
        line["note"] = "flash-linear-attention not installed (or no CUDA): the fallback alone"
    else:
        got, kernel_s = run(tensors, resets, use_kernel=True, reps=args.reps)
        line["kernel_s"] = statistics.median(kernel_s)
        names = ("out", "state", "dq", "dk", "dv", "dg", "dbeta")
        line["rel_err"] = {n: rel(a, b) for n, a, b in zip(names, got, fallback)}
        line["kernel_speedup"] = line["fallback_s"] / line["kernel_s"]
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
