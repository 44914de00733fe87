"""Wire a validated config into a Lightning run: data, module, callbacks, resume, final checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.plugins.environments import SLURMEnvironment
from torch.utils.tensorboard.summary import hparams

from neva.checkpoint import verified
from neva.checkpoint.neva_format import run_metadata
from neva.checkpoint.source import resolve_source
from neva.config import TrainConfig
from neva.data.datamodule import NevaDataModule
from neva.families import part
from neva.parallel.collective_timeout import timeout_note
from neva.parallel.layout import global_rank, resolve_layout
from neva.parallel.leave import leave_together
from neva.parallel.run_rules import check_stage
from neva.parallel.strategy import build_strategy
from neva.stages import stage_spec
from neva.training import quiet
from neva.training.callbacks import AtomicCheckpointIO, MetricsCSV, StepCheckpoints, StepProgressBar
from neva.training.eval_hook import EvalDuringTraining, InTrainingEval
from neva.training.export import save_final
from neva.training.guards import check_trained, plan_steps, plan_training_data
from neva.training.module import NevaModule
from neva.training.stop_signal import StopOnSignal, StoppedBySignal, ignore_further_signals
from neva.typed import ConfigError

log = logging.getLogger("neva.train")

quiet.install()  # third-party lines that are not about the run, by message (neva.training.quiet)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys; values TensorBoard's hparams take (numbers, strings, booleans; others as text)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def log_config(loggers: list[Any], cfg: TrainConfig) -> None:
    """The resolved config as the loggers' hyperparameters (TensorBoard's HPARAMS tab, W&B's config)."""
    params = _flat(dataclasses.asdict(cfg))
    for logger in loggers:
        logger.log_hyperparams(params)  # TensorBoard: hparams.yaml; W&B: the run config
        if isinstance(logger, TensorBoardLogger):
            # Lightning writes TensorBoard's hparams event only together with metric values; the metric columns are
            # declared here and their values are the run's own scalars.
            for summary in hparams(params, {"train_loss": 0.0, "val_loss": 0.0}):
                logger.experiment.file_writer.add_summary(summary)


def data_module_type(cfg: TrainConfig) -> Callable[..., NevaDataModule]:
    """The stage's data module (its spec's ``data_module``), conversations where it names none. The stage's refused
    settings (``run_rules.check_stage``, one of ``check_run``'s rules) are refused here already, before data and model
    are built."""
    check_stage(cfg)
    stage = stage_spec(cfg.stage)
    return NevaDataModule if stage.data_module is None else part(stage.data_module)(cfg)


def run(
    cfg: TrainConfig,
    forecast: Callable[[TrainConfig], str] | None = None,
    evaluation: InTrainingEval | None = None,
) -> Path | None:
    """Train one stage; returns the consolidated checkpoint's path (None on non-writing ranks).

    ``forecast``: the line rank 0 logs before anything is built (``neva.planner.forecast.forecast_line``, handed
    in by ``neva.train``: the planner is training's sibling, not its dependency). ``evaluation``: the benchmarks of
    ``model.eval``, run every ``model.eval.every_n_steps`` (``neva.training_eval``, handed in the same way).
    """
    exp_dir = Path(cfg.exp_manager.exp_dir)
    layout = resolve_layout(cfg)
    if forecast is not None and global_rank() == 0:
        log.info("%s", forecast(cfg))
    pl.seed_everything(cfg.model.seed, workers=True, verbose=False)
    source = resolve_source(cfg)
    data = data_module_type(cfg)(
        cfg.model.data,
        source.tokenizer,
        source.cfg,
        micro_batch_size=cfg.model.micro_batch_size,
        dp_rank=layout.dp_rank,
        dp_world=layout.dp,
        seed=cfg.model.seed,
        accumulation=layout.grad_accum,
        device_type=layout.device_type,
        plan_dir=exp_dir / "data_plan",  # a streaming blend's epoch order: built once, memory-mapped by every rank
    )
    plan_training_data(data)
    # Epochs become steps here, so the learning-rate schedule, resume and Lightning all see one step count.
    cfg = replace(cfg, trainer=replace(cfg.trainer, max_steps=plan_steps(cfg.trainer, data)))
    timeout = timedelta(minutes=cfg.model.distributed_timeout_minutes)
    strategy = build_strategy(layout, timeout)
    is_writer = int(os.environ.get("RANK", "0")) == 0
    metrics = MetricsCSV(exp_dir / "metrics.csv", enabled=is_writer)
    module = NevaModule(cfg, source, data, layout, metrics=metrics)
    ckpt_dir = exp_dir / "checkpoints"
    params = cfg.exp_manager.checkpoint_callback_params
    callbacks = [
        StepCheckpoints(ckpt_dir, params.every_n_train_steps, params.save_last, params.save_top_k),
        StopOnSignal(ckpt_dir / "last.ckpt"),  # SIGTERM / SIGINT / SIGUSR1: checkpoint, exit 128 + signal, no final
    ]
    if evaluation is not None and cfg.model.eval.every_n_steps > 0:
        callbacks.insert(0, EvalDuringTraining(evaluation, cfg.model.eval.every_n_steps))  # before the bar's update
    if cfg.trainer.enable_progress_bar:
        callbacks.append(StepProgressBar(refresh_rate=max(1, cfg.trainer.log_every_n_steps // 2)))
    loggers = []
    if cfg.exp_manager.create_tensorboard_logger:
        # no placeholder hp_metric: the hyperparameters below are the resolved config, the metrics the run's own
        loggers.append(TensorBoardLogger(str(exp_dir), name="tensorboard", version="", default_hp_metric=False))
    if cfg.exp_manager.create_wandb_logger:
        from pytorch_lightning.loggers import WandbLogger

        loggers.append(WandbLogger(save_dir=str(exp_dir), **cfg.exp_manager.wandb_logger_kwargs))
    trainer = pl.Trainer(
        strategy=strategy,
        devices=layout.world // cfg.trainer.num_nodes if layout.is_distributed else 1,
        num_nodes=cfg.trainer.num_nodes,
        max_steps=cfg.trainer.max_steps,
        max_epochs=-1,  # max_steps already holds trainer.max_epochs (plan_steps)
        val_check_interval=cfg.trainer.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=cfg.trainer.limit_val_batches,
        num_sanity_val_steps=cfg.trainer.num_sanity_val_steps,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        enable_progress_bar=cfg.trainer.enable_progress_bar,
        enable_model_summary=False,
        deterministic=cfg.trainer.deterministic,
        logger=loggers or False,
        callbacks=callbacks,
        # Under SLURM, Lightning's own SIGUSR1 handler would requeue the job without neva's stop checkpoint;
        # scripts/slurm/launch.sh requeues once the tasks stopped with it (StopOnSignal).
        plugins=[AtomicCheckpointIO(), *([SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else [])],
        default_root_dir=str(exp_dir),
        use_distributed_sampler=False,
    )
    if is_writer:
        log_config(trainer.loggers, cfg)
    if is_writer:
        verified.remove_stale_temp(ckpt_dir)
    resume = resume_checkpoint(cfg, ckpt_dir)
    ckpt_path = str(resume) if resume else None
    final = exp_dir / "final"
    try:
        with warnings.catch_warnings():
            if ckpt_path:
                # The step comes from the verified manifest; SLURM users read this line to see where a requeued
                # attempt continues (scripts/slurm/README.md).
                log.info("resuming from %s at step %d", ckpt_path, verified.read_manifest(resume)["step"])
                # Lightning warns whenever the checkpoint directory is not empty; resuming from it is the point.
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            try:
                trainer.fit(module, ckpt_path=ckpt_path)
            except StoppedBySignal:
                ignore_further_signals()
                leave_together()
                raise
        check_trained(trainer, data, layout.dp)
        save_final(module.engine, source, final, is_writer=trainer.is_global_zero, **run_metadata(cfg))
        leave_together()
    except Exception as err:
        if layout.is_distributed and (note := timeout_note(err, timeout, global_rank(), layout)):
            log.error(note)
            err.add_note(note)
        raise
    return final if trainer.is_global_zero else None


def resume_checkpoint(cfg: TrainConfig, ckpt_dir: Path) -> Path | None:
    """``exp_manager.resume_from_checkpoint`` when set (verified against its manifest; once the run has checkpoints
    of its own in ``ckpt_dir``, a chosen one outside it gives way to them), else the newest intact checkpoint in
    ``ckpt_dir`` when ``exp_manager.resume_if_exists``, else None.

    Raises:
        ConfigError: ``resume_from_checkpoint`` names nothing that exists.
        CheckpointError: it exists but does not verify.
    """
    chosen = cfg.exp_manager.resume_from_checkpoint
    own = verified.find_resume(ckpt_dir) if cfg.exp_manager.resume_if_exists else None
    if chosen:
        path = Path(chosen)
        if not path.exists():
            raise ConfigError(f"exp_manager.resume_from_checkpoint={chosen!r}: no such checkpoint file or directory")
        # A run that started from another run's checkpoint and has saved its own since (then was preempted and
        # requeued with the same arguments) continues from its own: starting over would lose its steps. A chosen
        # checkpoint inside exp_dir (going back to an earlier step) is taken as asked.
        if own is not None and path.resolve().parent != ckpt_dir.resolve():
            log.info("exp_manager.resume_from_checkpoint=%s: this run has saved its own checkpoints since", chosen)
            return own
        verified.verify(path)
        return path
    return own
