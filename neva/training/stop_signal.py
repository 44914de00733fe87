"""SIGTERM, SIGINT and SIGUSR1 stop a run at the next step boundary, after writing the checkpoint a rerun resumes from.

SIGUSR1 is SLURM's warning before the time limit (``--signal=USR1@...``, forwarded to the tasks by
``scripts/slurm/launch.sh``, which requeues the job once they exited with 138). The run then exits with
``128 + the signal's number`` (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1, the shell's convention for
"ended by that signal") and writes no ``final``: it did not train what was asked. Further signals change nothing: under
torchrun or SLURM a rank often gets the same signal twice (from the scheduler and from its launcher), so they must not
cut the checkpoint short; SIGKILL still stops a process at once (every checkpoint on disk is complete either way).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StoppedBySignal(SystemExit):
    """Ends the process with ``128 + signum`` once the stop checkpoint is written (a ``SystemExit``, as Lightning's own
    ``SIGTERMException``: Lightning tears the run down and re-raises it, and no traceback is printed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class StopOnSignal(pl.Callback):
    """Turns SIGTERM / SIGINT / SIGUSR1 into a checkpoint at ``path`` at the next step boundary, then ``StoppedBySignal``.

    Every rank takes part in a max-reduction of the received signal after each step, so under torchrun all ranks stop
    after the same step and write the same checkpoint, whichever of them got the signal and when.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.received = 0  # number of the first signal received, 0 = none
        self._previous: dict[int, Any] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Installed already here, before the first step: a signal that comes while the model is being built is acted
        # on after the first step instead of killing the process without a checkpoint.
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
            for signum in SIGNALS:
                signal.signal(signum, self._handle)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Only reached when fit ends normally (a stop re-raises before it): the handlers found at setup come back.
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning has just installed its own SIGTERM handler, which ends the run with exit status 0 and no checkpoint
        # (and broadcasts from inside the handler under torchrun); these replace it until fit ends, when Lightning
        # restores the handlers it found.
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received:
            return
        self.received = signum
        # os.write, not logging: a handler that prints while the interrupted code prints raises a reentrancy error.
        os.write(2, f"{signal.Signals(signum).name} received: stopping after this step with a checkpoint\n".encode())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        flag = torch.tensor(float(self.received), device=trainer.strategy.root_device)
        signum = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        if not signum:
            return
        trainer.save_checkpoint(self.path, weights_only=False)
        if trainer.is_global_zero:
            log.error(
                "stopped by %s after step %d: %s is written and no final checkpoint; rerun the same command to "
                "continue (exit status %d)",
                signal.Signals(signum).name,
                trainer.global_step,
                self.path,
                128 + signum,
            )
        raise StoppedBySignal(signum)


def ignore_further_signals() -> None:
    """Called once ``StoppedBySignal`` has left ``trainer.fit`` (Lightning has restored the handlers it found): the
    rank exits after the shared checkpoint, and a further copy of the signal must not turn its documented status into
    143 (srun --kill-on-bad-exit sends SIGTERM to the ranks still exiting once the first one is gone). ``SIG_IGN``, not
    a Python handler: Python resets its handlers to the default action while the interpreter shuts down."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
