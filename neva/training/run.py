"""Wire a validated config into a Lightning run: data, module, callbacks, resume, final checkpoint."""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.callbacks import TQDMProgressBar

from neva.checkpoint import verified
from neva.checkpoint.source import resolve_source
from neva.config import TrainConfig
from neva.data.datamodule import NevaDataModule
from neva.parallel.collective_timeout import timeout_note
from neva.parallel.layout import global_rank, resolve_layout
from neva.parallel.strategy import build_strategy
from neva.training.callbacks import AtomicCheckpointIO, MetricsCSV, StepCheckpoints
from neva.training.export import save_final
from neva.training.guards import check_trained, plan_training_data
from neva.training.module import NevaModule
from neva.training.stop_signal import StopOnSignal

log = logging.getLogger("neva.train")

# With manual optimization Lightning cannot tell that neva checkpoints at step boundaries (after the optimizer step,
# which is what resume needs) and warns on every run.
warnings.filterwarnings("ignore", message=".*no pre-optimization state was saved.*")


def run(cfg: TrainConfig) -> Path | None:
    """Train one stage; returns the consolidated checkpoint's path (None on non-writing ranks)."""
    exp_dir = Path(cfg.exp_manager.exp_dir)
    layout = resolve_layout(cfg)
    pl.seed_everything(cfg.model.seed, workers=True, verbose=False)
    source = resolve_source(cfg)
    data = NevaDataModule(
        cfg.model.data,
        source.tokenizer,
        source.cfg,
        micro_batch_size=cfg.model.micro_batch_size,
        dp_rank=layout.dp_rank,
        dp_world=layout.dp,
        seed=cfg.model.seed,
        accumulation=layout.grad_accum,
        device_type=layout.device_type,
    )
    plan_training_data(data)
    timeout = timedelta(minutes=cfg.model.distributed_timeout_minutes)
    strategy = build_strategy(layout, timeout)
    is_writer = int(os.environ.get("RANK", "0")) == 0
    metrics = MetricsCSV(exp_dir / "metrics.csv", enabled=is_writer)
    module = NevaModule(cfg, source, data, layout, metrics=metrics)
    ckpt_dir = exp_dir / "checkpoints"
    params = cfg.exp_manager.checkpoint_callback_params
    callbacks = [
        StepCheckpoints(ckpt_dir, params.every_n_train_steps, params.save_last, params.save_top_k),
        StopOnSignal(ckpt_dir / "last.ckpt"),  # SIGTERM / SIGINT: checkpoint, then exit 128 + signal, no final
    ]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(TQDMProgressBar(refresh_rate=max(1, cfg.trainer.log_every_n_steps // 2)))
    loggers = []
    if cfg.exp_manager.create_tensorboard_logger:
        from pytorch_lightning.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(str(exp_dir), name="tensorboard", version=""))
    if cfg.exp_manager.create_wandb_logger:
        from pytorch_lightning.loggers import WandbLogger

        loggers.append(WandbLogger(save_dir=str(exp_dir), **cfg.exp_manager.wandb_logger_kwargs))
    trainer = pl.Trainer(
        strategy=strategy,
        devices=layout.world // cfg.trainer.num_nodes if layout.is_distributed else 1,
        num_nodes=cfg.trainer.num_nodes,
        max_steps=cfg.trainer.max_steps,
        max_epochs=cfg.trainer.max_epochs,
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
        plugins=[AtomicCheckpointIO()],
        default_root_dir=str(exp_dir),
        use_distributed_sampler=False,
    )
    if is_writer:
        verified.remove_stale_temp(ckpt_dir)
    resume = verified.find_resume(ckpt_dir) if cfg.exp_manager.resume_if_exists else None
    ckpt_path = str(resume) if resume else None
    final = exp_dir / "final"
    try:
        with warnings.catch_warnings():
            if ckpt_path:
                log.info("resuming from %s", ckpt_path)
                # Lightning warns whenever the checkpoint directory is not empty; resuming from it is the point.
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            trainer.fit(module, ckpt_path=ckpt_path)
        check_trained(trainer, data, layout.dp)
        save_final(
            module.engine, source, final, is_writer=trainer.is_global_zero, stage=cfg.stage,
            image_aspect_ratio=cfg.model.data.image_aspect_ratio, conv_template=cfg.model.data.conv_template,
        )  # fmt: skip
    except Exception as err:
        if layout.is_distributed and (note := timeout_note(err, timeout, global_rank(), layout)):
            log.error(note)
            err.add_note(note)
        raise
    return final if trainer.is_global_zero else None
