"""Data-plan benchmark: seconds and peak memory to plan one epoch's order over many sources, order rule 2
(``neva.data.data_plan``) against rule 1 (the implementation before it: Megatron's draw-by-draw blend over
shard-by-shard passes) in the same run.

Each case is ``samples x sources``: every other source a shard set (shards of 1000 samples), the others record sets,
the samples split evenly, weights drawn uniformly in [0.5, 1.5) (seeded). Each measurement runs in its own child
process, so the peak resident memory is that build's (``ru_maxrss``; the imports' baseline is given beside it). Rule 2
also reads one global batch at a random sample (what a resumed rank does). Rule 1 is skipped above
``--data-plan-reference-limit`` samples x sources (it costs ~1 us per sample and source).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SHARD = 1000  # samples per shard, as the issue measured
BATCH = 512  # the global batch a resumed rank reads


def sources_of(samples: int, count: int, seed: int = 0) -> tuple[list, list[float]]:
    """``count`` sources of ``samples // count`` samples each, alternating shard sets and record sets, and weights."""
    per = samples // count
    sources = [[SHARD] * (per // SHARD) if d % 2 == 0 else per for d in range(count)]
    weights = (np.random.default_rng(seed).random(count) + 0.5).tolist()
    return sources, weights


def rule1_order(sources: list, weights: list[float], seed: int, epoch: int) -> np.ndarray:
    """Rule 1 as it was: ``blend_choices`` (a Python step per draw and source), each source's passes with one
    Python step (and one generator) per shard."""
    from neva.data.sampler import blend_choices, interleave
    from neva.data.source_stream import buffered_permutation, source_size

    def stream(d: int, cycle: int) -> np.ndarray:
        rng = np.random.default_rng([seed, epoch, d, cycle])
        source = sources[d]
        if isinstance(source, int):
            return rng.permutation(source)
        offsets = np.concatenate([[0], np.cumsum(source)])
        parts = [
            offsets[s] + buffered_permutation(source[s], 0, np.random.default_rng([seed, epoch, d, cycle, s]))
            for s in rng.permutation(len(source)).tolist()
        ]
        return np.concatenate(parts)

    sizes = [source_size(s) for s in sources]
    total = sum(sizes)
    w = np.asarray(weights) / sum(weights)
    return interleave(sizes, blend_choices(w.tolist(), total), stream)


def child(impl: str, samples: int, count: int, plan_dir: str | None) -> dict[str, Any]:
    """One measurement in this process: build the order, then (rule 2) read a global batch at a random sample."""
    from neva.data.data_plan import build_plan

    sources, weights = sources_of(samples, count)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start, cpu = time.perf_counter(), time.process_time()
    if impl == "rule1":
        order = rule1_order(sources, weights, 0, 0)
        read_ms = None
    else:
        out = Path(plan_dir) if plan_dir else None
        order = build_plan(sources, weights, 0, 0, out_dir=out, stem="bench")
        built = time.perf_counter()
        at = int(np.random.default_rng(1).integers(0, len(order) - BATCH))
        order[at : at + BATCH]
        read_ms = (time.perf_counter() - built) * 1e3
    seconds = time.perf_counter() - start - (read_ms or 0) / 1e3
    cpu_seconds = time.process_time() - cpu  # the build's own CPU time: what one free core would take
    return {
        "impl": impl,
        "samples": samples,
        "sources": count,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "read_batch_ms": read_ms,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "import_mb": baseline,
        "memory_mapped": bool(plan_dir),
        "drawn": len(order),
    }


def _measure(script: str, impl: str, samples: int, count: int, plan_dir: str | None) -> dict[str, Any]:
    cmd = [sys.executable, script, "--data-plan-child", f"{impl}:{samples}:{count}:{plan_dir or ''}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_data_plan(args: Any, script: str) -> dict[str, Any]:
    """Every case of ``args.data_plan_cases``: rule 2 (in memory, or memory-mapped from ``--data-plan-files`` up)
    and rule 1 where affordable; prints a table and returns the summary."""
    rows = []
    for case in args.data_plan_cases.split(","):
        samples_text, count_text = case.split("x")
        samples, count = int(float(samples_text)), int(count_text)
        with tempfile.TemporaryDirectory() as tmp:
            mapped = tmp if samples >= args.data_plan_files else None
            rows.append(_measure(script, "rule2", samples, count, mapped))
        if samples * count <= args.data_plan_reference_limit:
            rows.append(_measure(script, "rule1", samples, count, None))
    head = f"{'samples':>13} {'sources':>7} {'impl':>5} {'seconds':>8} {'cpu s':>8} {'peak MB':>13} {'imports MB':>10}"
    print(head + f" {'read ms':>8}")
    for r in rows:
        read = "-" if r["read_batch_ms"] is None else f"{r['read_batch_ms']:.1f}"
        mb = f"{r['peak_mb']:.0f}" + (" (mmap)" if r["memory_mapped"] else "")
        print(
            f"{r['samples']:>13,} {r['sources']:>7} {r['impl']:>5} {r['seconds']:>8.2f} {r['cpu_seconds']:>8.2f} {mb:>13} "
            f"{r['import_mb']:>10.0f} {read:>8}"
        )
    speedups = {}
    for r in rows:
        if r["impl"] == "rule1":
            new = next(x for x in rows if x["impl"] == "rule2" and x["samples"] == r["samples"])
            speedups[f"{r['samples']}x{r['sources']}"] = r["seconds"] / new["seconds"]
    for case, ratio in speedups.items():
        print(f"{case}: rule 2 {ratio:.0f}x faster than rule 1 in this run")
    return {"mode": "data_plan", "rows": rows, "speedup": speedups}
