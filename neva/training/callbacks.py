"""Run outputs: ``metrics.csv`` that survives resume, and atomic checkpoint files."""

from __future__ import annotations

import csv
import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins import CheckpointIO
from lightning_fabric.utilities.types import _PATH


def atomic_write(path: str | os.PathLike, write) -> None:
    """``write(file_object)`` into a temp file beside ``path``, fsync, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AtomicCheckpointIO(CheckpointIO):
    """``torch.save`` through a temp file and a rename, so a crash mid-save never leaves a complete-looking file."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if Path(path).is_dir():  # a distributed run's DCP checkpoint of the same name, resumed here in one process
            shutil.rmtree(path)
        atomic_write(path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        # Our own checkpoints hold numpy RNG state and config objects, so the full unpickler is needed; only load
        # checkpoints you wrote.
        return torch.load(path, map_location=map_location or "cpu", weights_only=False)

    def remove_checkpoint(self, path: _PATH) -> None:
        if Path(path).is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            Path(path).unlink(missing_ok=True)


class MetricsCSV:
    """``<exp_dir>/metrics.csv``: one row per step (training and validation metrics merged), resume-safe.

    The module records a step's row inside ``training_step``, i.e. before that step's checkpoint can be written, and
    the file is rewritten atomically at each record. On resume from step k, rows after k (computed by the
    interrupted run but not covered by its checkpoint) are dropped, because the resumed run computes them again.
    """

    def __init__(self, path: str | os.PathLike, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self.rows: dict[int, dict[str, Any]] = {}
        if enabled and self.path.exists():
            with open(self.path, newline="") as f:
                for row in csv.DictReader(f):
                    step = int(float(row["step"]))
                    self.rows[step] = {k: v for k, v in row.items() if v not in ("", None)}

    def truncate_after(self, step: int) -> None:
        self.rows = {s: r for s, r in self.rows.items() if s <= step}
        self.save()

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = self.rows.setdefault(step, {})
        row.update(metrics)
        row["step"] = step
        self.save()

    def save(self) -> None:
        if not self.enabled:
            return
        columns = ["step"] + sorted({k for r in self.rows.values() for k in r} - {"step"})
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(self.rows[s] for s in sorted(self.rows))
        atomic_write(self.path, lambda f: f.write(buf.getvalue().encode()))
