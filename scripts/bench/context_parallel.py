"""Context-parallel mode (``--context-parallel``): what context parallelism's key/value all-gather costs, measured.

One packed row of ``--cp-seq`` tokens (``--cp-docs`` documents) through a Llama decoder of ``--cp-layers`` layers
(hidden 512, 8 heads; ``--cp-kv-heads`` key/value heads: 8 is multi-head attention, the most a gather moves),
forward and backward of the summed token loss, fp32, one thread per process:

- ``one process``: the whole row;
- ``cp2``: two gloo processes, each its share of the row (``split_batch``: chunks r and 3 − r), keys and values
  all-gathered per layer (the backward's reduce of their gradients too) — neva's attention under CP;
- ``cp2, no collective``: the same two processes with the gather replaced by a local tensor of the gathered shape:
  the same compute, no communication. ``cp2`` minus this is the gathers' exposed time.

Reported: medians of the step seconds (``--steps`` after ``--warmup``), the gathers' share of the CP2 step, each
process's peak RSS above its state before the first step (MB), and the numbers the all-gather moves. On a CPU the
collective goes through gloo over loopback TCP, which is slow beside NVLink: the share here bounds what a ring
attention (which overlaps the transfer with compute) could save on such a link.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, HEADS, VOCAB = 512, 8, 1024


def _batch(seq: int, docs: int, seed: int = 0) -> Any:
    """One packed row: ``docs`` documents of equal length, each with its own positions; every token learned."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, seq), generator=g)
    doc = seq // docs
    segments = (torch.arange(seq) // doc).clamp(max=docs - 1) + 1
    positions = torch.arange(seq) - (segments - 1) * doc
    from neva.data.micro_batch import MicroBatch

    return MicroBatch(input_ids=ids, labels=ids.clone(), position_ids=positions.view(1, 1, seq),
                      segment_ids=segments.view(1, seq))  # fmt: skip


def _model(layers: int, kv_heads: int, seq: int) -> torch.nn.Module:
    from neva.models.config import LLMConfig
    from neva.models.llama import LlamaDecoder

    torch.manual_seed(0)
    cfg = LLMConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1408, num_layers=layers,
                    num_heads=HEADS, num_kv_heads=kv_heads, max_seq_len=seq)  # fmt: skip
    return LlamaDecoder(cfg)


def _step(model: torch.nn.Module, batch: Any, context: Any) -> float:
    from neva.models.loss import token_cross_entropy

    start = time.perf_counter()
    h = model.tok_embeddings(batch.input_ids)
    logits = model(h, position_ids=batch.position_ids, segment_ids=batch.segment_ids, context=context)
    if context is None:
        loss = token_cross_entropy(logits, batch.labels)[0]
    else:  # each position's own next token (the split's next_labels)
        loss = token_cross_entropy(logits, batch.next_labels, shifted=True)[0]
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measure(model: torch.nn.Module, batch: Any, context: Any, warmup: int, steps: int) -> dict:
    base = _rss_mb()
    times = [_step(model, batch, context) for _ in range(warmup + steps)][warmup:]
    return {"step_s": statistics.median(times), "peak_rss_mb": _rss_mb() - base}


def _cp_worker(rank: int, port: int, args: Any, local_gather: bool, out: Any) -> None:
    from dataclasses import replace

    from neva.parallel.context_parallel import split_batch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = _model(args.cp_layers, args.cp_kv_heads, args.cp_seq)
    shard = split_batch(_batch(args.cp_seq, args.cp_docs), 2, rank, dist.group.WORLD, packed=True)
    if local_gather:  # the gathered shape from this rank's own tensor: the same compute without a collective
        shard = shard.with_(
            context=replace(shard.context, gather=lambda t, dim, sizes: torch.cat([t] * len(sizes), dim))
        )
    dist.barrier()
    result = _measure(model, shard, shard.context, args.warmup, args.steps)
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _one_process(rank: int, args: Any, out: Any) -> None:
    torch.set_num_threads(1)
    model = _model(args.cp_layers, args.cp_kv_heads, args.cp_seq)
    out.put((rank, _measure(model, _batch(args.cp_seq, args.cp_docs), None, args.warmup, args.steps)))


def _spawn(target: Any, nprocs: int, *extra: Any) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *extra, queue)) for r in range(nprocs)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a benchmark process exited with {p.exitcode}")
    return [results[r] for r in range(nprocs)]


def run_context_parallel(args: Any) -> dict[str, Any]:
    """Measure the three cases one after another (never two at once) and print the table."""
    if args.cp_seq % (4 * args.cp_docs):
        raise SystemExit(f"--cp-seq {args.cp_seq} must be a multiple of 4 x --cp-docs ({args.cp_docs})")
    one = _spawn(_one_process, 1, args)[0]
    cp2 = _spawn(_cp_worker, 2, _port(), args, False)
    local = _spawn(_cp_worker, 2, _port(), args, True)
    cp2_s, local_s = max(r["step_s"] for r in cp2), max(r["step_s"] for r in local)
    head_dim = HIDDEN // HEADS
    gathered_mb = 2 * args.cp_seq * args.cp_kv_heads * head_dim * 4 / 2**20  # K and V of the whole row, fp32
    summary = {
        "mode": "context_parallel", "seq": args.cp_seq, "docs": args.cp_docs, "layers": args.cp_layers,
        "kv_heads": args.cp_kv_heads, "steps": args.steps,
        "one_process_step_s": one["step_s"], "cp2_step_s": cp2_s, "cp2_local_gather_step_s": local_s,
        "gather_share": (cp2_s - local_s) / cp2_s, "speedup_cp2": one["step_s"] / cp2_s,
        "peak_rss_mb": {"one_process": one["peak_rss_mb"], "cp2": [r["peak_rss_mb"] for r in cp2]},
        "gathered_kv_mb_per_layer": gathered_mb,
    }  # fmt: skip
    print(f"{'case':<26}{'step s (median)':>16}{'peak RSS MB':>14}")
    print(f"{'one process':<26}{one['step_s']:>16.3f}{one['peak_rss_mb']:>14.0f}")
    print(f"{'cp2':<26}{cp2_s:>16.3f}{max(r['peak_rss_mb'] for r in cp2):>14.0f}")
    print(f"{'cp2, no collective':<26}{local_s:>16.3f}{max(r['peak_rss_mb'] for r in local):>14.0f}")
    print(
        f"gathers: {100 * summary['gather_share']:.1f}% of the CP2 step; {gathered_mb:.1f} MB of keys and values "
        f"gathered per layer; CP2 {summary['speedup_cp2']:.2f}x one process's step"
    )
    return summary


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
