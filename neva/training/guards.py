"""Checks that keep a run from exiting 0 when it did not train what was asked.

Before training: the data is read and the first epoch planned, so a data set that cannot fill one optimizer step
stops the run before any model is built. After training, before the final checkpoint: the skip fraction over the
whole run (``min_samples`` only defers the check during the run) and at least one optimizer step. A run stopped here
keeps everything it wrote (checkpoints, ``metrics.csv``) and writes no ``final``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from neva.data.skips import SkipTracker
from neva.typed import ConfigError

if TYPE_CHECKING:
    from neva.config import TrainerConfig
    from neva.data.datamodule import NevaDataModule

log = logging.getLogger("neva.train")


class NothingTrained(RuntimeError):
    """The run ended without a single optimizer step."""


def plan_training_data(data: NevaDataModule) -> None:
    """Read the training data and plan its first epoch now.

    Raises:
        ConfigError: a data file that cannot be read as records, or fewer samples than one global batch.
    """
    try:
        data.train_dataloader()
    except ValueError as err:
        raise ConfigError(f"model.data.data_path={data.cfg.data_path!r}: {err}") from err


def plan_steps(trainer: TrainerConfig, data: NevaDataModule) -> int:
    """Optimizer steps the run takes (``TrainerConfig.steps_to_train`` over the planned epoch), logged.

    Call after ``plan_training_data``: an epoch of the data holds at least one whole step (the sampler refuses less),
    so a run asked for epochs never trains 0 steps.
    """
    per_epoch = data.train_sampler.num_steps // data.accumulation
    steps = trainer.steps_to_train(per_epoch)
    # the samples the whole run draws: once more of them are skipped than the limit allows, the end's check is certain
    data.skip_tracker.planned = steps * data.train_sampler.global_batch * data.accumulation
    if trainer.max_epochs > 0:
        log.info(
            "one epoch = %d optimizer steps (%d samples, global batch %d); trainer.max_epochs=%d, "
            "trainer.max_steps=%d -> %d steps (whichever limit comes first)",
            per_epoch, sum(data.train_sampler.sizes), data.train_sampler.global_batch * data.accumulation,
            trainer.max_epochs, trainer.max_steps, steps,
        )  # fmt: skip
    return steps


def check_trained(trainer: Any, data: NevaDataModule, dp: int) -> None:
    """The end-of-run checks, on every rank alike (the skip counts are summed over all ranks first).

    Raises:
        DataQualityError: more than ``max_skip_fraction`` of the samples seen were skipped, however few.
        NothingTrained: no optimizer step was taken (every global batch had no learned token).
    """
    tracker = data.skip_tracker
    if dist.is_available() and dist.is_initialized():
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, tracker.state_dict())
        tracker = SkipTracker(tracker.max_skip_fraction, tracker.min_samples)
        tracker.merge(states, copies=dist.get_world_size() // dp)
    tracker.check()
    # The scheduler steps exactly once per optimizer step and is restored on resume: its count covers the whole
    # training, not just this process.
    steps = trainer.lr_scheduler_configs[0].scheduler.last_epoch if trainer.lr_scheduler_configs else 0
    if steps == 0:
        raise NothingTrained(
            f"no optimizer step in {trainer.global_step} step(s): no global batch held a learned token "
            f"(skipped samples by reason: {tracker.report()}); nothing was trained, so no final checkpoint is written"
        )
