"""Precomputed reference log-probs (``model.dpo.precompute_ref_log_probs=true``): one pass over the training pairs.

Before the first step, the reference (the frozen starting weights, or LoRA's adapters-off model) scores every training
pair whose record does not carry its values (TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` win), micro-batch by
micro-batch, in dataset order; the values go to ``<exp_dir>/reference_logps.pt`` and the pairs read them from there
(``neva.data.preference.PreferenceDataset.reference_table``); the reference is then dropped, so training holds one
model. The file is written atomically every ``SAVE_EVERY`` micro-batches and at the end, with a key: a preempted pass
continues where its last write stopped, and a file of other data or another reference is refused (``reference_key``).

Every rank scores every pair (a reference sharded over tensor, pipeline or data-parallel ranks runs its collectives on
all of them); rank 0 writes the file. Under pipeline parallelism only the last stage holds the values: they are summed
over the stages (the others hold zeros).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from neva.checkpoint.atomic import atomic_write
from neva.data.dataset import is_skipped
from neva.data.micro_batch import pad_micro_batches
from neva.data.preference import carries_reference
from neva.errors import ConfigError

FILE = "reference_logps.pt"
SAVE_EVERY = 32  # micro-batches between two writes of the file during the pass


def source_identity(path: str | None) -> list[Any]:
    """The reference's weights as the key sees them: each file of its checkpoint (name, size, modification time), so
    a rewritten checkpoint changes the key; the path alone where it is not a local directory or file."""
    if path is None:
        return ["fresh"]
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.is_file() else []
    return [str(p.resolve())] + [(str(f.relative_to(p) if p.is_dir() else f.name), f.stat().st_size,
                                  f.stat().st_mtime_ns) for f in files]  # fmt: skip


def settings_identity(settings: Any) -> dict[str, Any]:
    """The encoder settings that decide a pair's tokens: plain values, the template by its kind and texts, the
    tokenizer by name and size (no object's address, which would change the key from run to run)."""
    objects = ("tokenizer", "video_tokens", "template")
    out = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name not in objects}
    tokenizer, template = settings.tokenizer, settings.template
    out["tokenizer"] = (getattr(tokenizer, "name_or_path", type(tokenizer).__name__), len(tokenizer))
    texts = ("name", "default_system", "eot", "assistant_cue")
    out["template"] = (type(template).__name__, *(str(getattr(template, a, None)) for a in texts))
    return out


def reference_key(records: list[list[Any]], settings: Any, source: Any, mean: bool, precision: str) -> str:
    """sha256 of what the values depend on: the training records (each dataset's, in order), the encoder settings
    (template, lengths, image tokens), the reference's checkpoint, whether a reply's log-prob is a token mean (IPO)
    and the precision the reference runs in."""
    h = hashlib.sha256()
    parts = (records, settings_identity(settings), source_identity(source.checkpoint), source.hf_llm, mean, precision)
    for part in parts:
        h.update(json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()


def _load(path: Path, key: str, n: int) -> torch.Tensor | None:
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("key") != key or saved["values"].shape != (n, 2):
        raise ConfigError(
            f"{path} holds reference log-probs of other training data or another reference model; delete it (or use "
            "a new exp_manager.exp_dir) to compute them again"
        )
    return saved["values"]


def _save(path: Path, key: str, values: torch.Tensor) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        atomic_write(path, lambda f: torch.save({"key": key, "values": values}, f))


def precompute_reference_logps(
    datasets: list[Any],
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
    reference: Callable[[dict[str, Any]], torch.Tensor],
    engine: Any,
    path: Path,
    key: str,
    micro_batch_size: int,
    pp_group: Any = None,
    after_batch: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The reference log-probs ``[N, 2]`` (chosen, rejected) of the pairs of ``datasets`` (concatenated), NaN for a
    skipped pair or one whose record carries its own; continued from ``path`` when it holds part of them.

    ``after_batch(i)`` runs after the ``i``-th scored micro-batch of this call (a preemption's stop check)."""
    sizes = [len(d) for d in datasets]
    n = sum(sizes)
    values = _load(path, key, n)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank has read the file before rank 0 writes it again: all score the same pairs
    done = values is not None and not bool(values.isinf().any())
    if values is None:
        values = torch.full((n, 2), float("inf"))  # inf: not scored yet; NaN: no value (skipped, or the record's)
    if done:
        return values
    todo = []
    offset = 0
    for dataset, size in zip(datasets, sizes):
        for i in range(size):
            if not torch.isinf(values[offset + i]).any():
                continue
            if not carries_reference(dataset.base.records[i]):
                todo.append((dataset, i, offset + i))
            else:
                values[offset + i] = float("nan")
        offset += size
    try:
        _score(todo, values, collate, reference, engine, path, key, micro_batch_size, pp_group, after_batch)
    except BaseException:  # preempted or failed: what is scored stays scored for the next run
        _save(path, key, values)
        raise
    _save(path, key, values)
    return values


def _score(todo, values, collate, reference, engine, path, key, micro_batch_size, pp_group, after_batch) -> None:
    for b, start in enumerate(range(0, len(todo), micro_batch_size)):
        chunk = todo[start : start + micro_batch_size]
        items = [(dataset.item(i, reference=False), row) for dataset, i, row in chunk]
        good = [(item, row) for item, row in items if not is_skipped(item)]
        for item, row in items:
            if is_skipped(item):
                values[row] = float("nan")
        if good:
            batch = collate([item for item, _ in good])
            batch = pad_micro_batches([batch], engine.sp_multiple)[0] if engine.sp_multiple > 1 else batch
            with engine._loss_context():
                logps = reference(batch).detach().float()
            if pp_group is not None:  # only the last stage holds them
                dist.all_reduce(logps, group=pp_group)
            p = len(good)
            for k, (_, row) in enumerate(good):
                values[row] = torch.stack([logps[k], logps[p + k]]).cpu()
        if (b + 1) % SAVE_EVERY == 0:
            _save(path, key, values)
        if after_batch is not None:
            after_batch(b)


def attach_precomputed(
    datasets: list[Any],
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
    make_reference: Callable[[], Callable[[dict[str, Any]], torch.Tensor]],
    engine: Any,
    exp_dir: str | os.PathLike,
    source: Any,
    mean: bool,
    precision: str,
    micro_batch_size: int,
    pp_group: Any = None,
) -> Path:
    """Give each of ``datasets`` (the run's training then validation sets) its rows of ``<exp_dir>/reference_logps.pt``
    (``reference_table``), scoring first what the file lacks with the reference ``make_reference`` builds (not built
    when the file is complete: a resumed run loads one model); returns the file."""
    path = Path(exp_dir) / FILE
    key = reference_key([d.base.records for d in datasets], datasets[0].base.settings, source, mean, precision)
    values = _load(path, key, sum(len(d) for d in datasets))
    if values is None or bool(values.isinf().any()):
        reference = make_reference()
        values = precompute_reference_logps(datasets, collate, reference, engine, path, key, micro_batch_size, pp_group)
    for dataset, rows in zip(datasets, values.split([len(d) for d in datasets])):
        dataset.reference_table = rows
    return path
