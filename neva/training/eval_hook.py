"""Evaluation during training (``model.eval``): every ``every_n_steps`` the training model itself answers the
configured benchmarks, and the next step runs exactly as it would have without (``training_state_kept``).

What is answered and how it is scored is handed in (``InTrainingEval``, built by ``neva.training_eval`` from the
benchmarks and the inference front end, training's siblings); this layer owns when it runs, what it may not change,
and where the scores go: ``metrics.csv`` and the loggers at the step, the progress bar.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from neva.training.engine import Engine

InTrainingEval = Callable[[Engine, Any, int], dict[str, float]]
"""``(engine, tokenizer, step)`` → the scores, named ``eval/<benchmark>/<metric>``, the same on every rank. Every
rank calls it (the model's forwards are collectives in parallel layouts)."""


@contextlib.contextmanager
def training_state_kept(engine: Engine) -> Iterator[None]:
    """The model in eval mode (no dropout) without autograd for the block; afterwards every module's train / eval
    mode and the torch (CPU and CUDA), numpy and Python RNG states are as they were, so the next training step is
    bit-identical to a run without the block. The weights are only read: no parameter, gradient or optimizer state is
    written by generation."""
    modules = [m for part in [engine.model, *engine.parts] for m in part.modules()]
    modes = [(m, m.training) for m in modules]
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        engine.model.eval()
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def progress_bar_keys(metrics: dict[str, float]) -> list[str]:
    """The headline scores shown on the bar: each benchmark's top-level numbers (``eval/<bench>/<metric>``), not its
    per-split or per-category ones nor its question counts."""
    return [k for k in metrics if k.count("/") == 2 and not k.endswith(("/questions", "/skipped"))]


class EvalDuringTraining(pl.Callback):
    """Runs ``evaluate`` after every ``every_n_steps``-th optimizer step (on every rank), before that step's
    checkpoint is written."""

    def __init__(self, evaluate: InTrainingEval, every_n_steps: int) -> None:
        self.evaluate = evaluate
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_steps <= 0 or step % self.every_n_steps:
            return
        with training_state_kept(pl_module.engine):
            metrics = self.evaluate(pl_module.engine, pl_module.source.tokenizer, step)
        pl_module.record_metrics(step, metrics)
        for key in progress_bar_keys(metrics):
            pl_module.log(key, metrics[key], prog_bar=True, logger=False)
