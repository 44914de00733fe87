"""Run outputs: ``metrics.csv`` that survives resume, verified checkpoint files, the progress bar."""

from __future__ import annotations

import csv
import io
import os
import shutil
from pathlib import Path
from typing import Any

from lightning_fabric.plugins import CheckpointIO
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.callbacks import ModelCheckpoint, TQDMProgressBar

from neva.checkpoint import verified
from neva.checkpoint.atomic import atomic_write


class AtomicCheckpointIO(CheckpointIO):
    """One-process checkpoint files: written atomically with a manifest (``neva.checkpoint.verified``), read back as
    tensors and plain data only."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if Path(path).is_dir():  # a distributed run's DCP checkpoint of the same name, resumed here in one process
            verified.remove_manifest(path)
            shutil.rmtree(path)
        verified.save_file(checkpoint, path)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return verified.load_state(path)

    def remove_checkpoint(self, path: _PATH) -> None:
        verified.remove_manifest(path)
        if Path(path).is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            Path(path).unlink(missing_ok=True)


class StepCheckpoints(ModelCheckpoint):
    """``step=N.ckpt`` every ``every_n_train_steps`` and ``last.ckpt``, keeping the newest ``save_top_k`` step
    checkpoints found on disk (-1: all, 0: none, only ``last.ckpt``).

    The newest are kept by listing the folder after each save rather than through Lightning's top-k memory, which
    forgets files it did not write itself (a moved run folder, a checkpoint skipped at resume).
    """

    def __init__(self, dirpath: Path, every_n_train_steps: int, save_last: bool, save_top_k: int) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step={step}",
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_train_steps,
            save_last=save_last,
            save_top_k=0 if save_top_k == 0 else -1,  # -1: Lightning keeps all; _save_checkpoint prunes
            # A step=N.ckpt that failed verification is overwritten when the run reaches N again, not versioned.
            enable_version_counter=False,
        )
        self.keep = save_top_k

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Lightning writes step checkpoints (and last.ckpt with them) at multiples of every_n_train_steps only: a run
        # of 125 steps every 50 would end with last.ckpt at step 100, 25 steps short of `final`. The last step of a
        # finished run gets its step=N.ckpt and last.ckpt here (a run stopped early by a signal writes its own).
        done = trainer.global_step >= trainer.max_steps > 0
        if self._every_n_train_steps and done and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if self.keep <= 0 or not verified.STEP_NAME.fullmatch(Path(filepath).name):
            return
        steps = sorted(
            (int(m.group(1)), name) for name in os.listdir(self.dirpath) if (m := verified.STEP_NAME.fullmatch(name))
        )
        for _, name in steps[: -self.keep]:
            trainer.strategy.remove_checkpoint(os.path.join(self.dirpath, name))


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


class StepProgressBar(TQDMProgressBar):
    """One bar over the whole run: optimizer steps towards ``trainer.max_steps`` (its ETA is the run's), from the
    resumed step; Lightning's bar counts the batches of one epoch and restarts at each epoch."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Here too, not only at an epoch's start: a run resumed inside an epoch starts no epoch, and its bar would
        # count steps towards no total ("106/?").
        super().on_train_start(trainer, pl_module)
        self._steps_bar(trainer)

    def on_train_epoch_start(self, trainer: Any, *_: Any) -> None:
        self._steps_bar(trainer)
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")

    def _steps_bar(self, trainer: Any) -> None:
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:  # the first epoch of this process
            bar.reset(total=trainer.max_steps)
            bar.initial = bar.n = trainer.global_step
            bar.refresh()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is not None and not bar.disable and self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar
