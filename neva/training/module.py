"""The LightningModule: one ``training_step`` = one optimizer step over a global batch's micro-batches."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from neva.checkpoint.source import ModelSource
from neva.checkpoint.start_record import START_KEY, start_record
from neva.config import TrainConfig
from neva.data.datamodule import NevaDataModule
from neva.data.micro_batch import MicroBatch
from neva.families import part
from neva.models.flops import SampleFlops, device_peak_tflops
from neva.models.neva import NevaModel
from neva.models.trainable import parameter_counts
from neva.parallel.layout import Layout
from neva.parallel.precision import Precision
from neva.stages import stage_spec
from neva.training.assembly import build_engine, build_parts
from neva.training.callbacks import MetricsCSV
from neva.training.engine import Engine
from neva.training.optim import build_optimizer, build_scheduler
from neva.training.resume_check import CONFIG_KEY, check_resume, config_record
from neva.training.tower_work import tower_patch_metrics

log = logging.getLogger(__name__)


def sample_lengths(batch: MicroBatch) -> list[int]:
    """Token count of each sample in a collated micro-batch (from its segment ids; padding is segment 0)."""
    out = []
    for row in batch.segment_ids:
        counts = torch.bincount(row)
        out += [int(c) for c in counts[1:] if c > 0]
    return out


def numpy_rng_state() -> dict[str, Any]:
    """numpy's global RNG state as tensors and numbers: checkpoints hold plain data only (they load with
    ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
            "gauss": gauss}  # fmt: skip


def set_numpy_rng_state(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["kind"], keys, state["pos"], state["has_gauss"], state["gauss"]))


class _Iterable:
    """Hides the loader's ``sampler`` attribute from Lightning, which would otherwise inspect it as a DataLoader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


class StepBatches:
    """The data module's training micro-batches in lists of one optimizer step each: ``accum`` of them, or as many as
    the step's token budget made (``model.data.max_tokens_per_micro_batch``; the loader says which closes a step).

    It measures ``wait``: the time the training loop spends blocked in the loader (Lightning fetches, and prefetches
    the next step's batches, in the loop's own thread, so every second in here is a second the device is not fed).

    It is the loader Lightning sees, and it follows Lightning's resumable-loader protocol with the data module's own
    state (sampler position and skip counts): Lightning stores ``state_dict()`` with its loop state in every
    checkpoint and calls ``load_state_dict`` on resume before the first batch is drawn, so training continues at the
    exact next sample (and Lightning, rightly, does not warn that the loader is not resumable).
    """

    def __init__(self, data: Any, accum: int) -> None:
        self.data = data
        self.loader = data.train_dataloader()
        self.accum = accum
        self.wait = 0.0

    def __len__(self) -> int:
        return self.loader.steps_left()

    def __iter__(self):
        group = []
        start = time.perf_counter()
        batches = iter(self.loader)  # (re)starts the workers: the loop waits for that too
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.wait += time.perf_counter() - start
            group.append(batch)
            if self.loader.closes_step:
                yield group
                group = []
            start = time.perf_counter()

    def take_wait(self) -> float:
        """Seconds the training loop spent blocked on the loader since the last call."""
        wait, self.wait = self.wait, 0.0
        return wait

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)


class NevaModule(pl.LightningModule):
    """Training and validation of a NeVA model under any layout.

    Manual optimization: each step runs ``Engine.forward_backward`` over the micro-batches of one global batch, so the
    loss is normalised by the global batch's learned tokens (exact accumulation) and pipeline schedules see all
    micro-batches at once.

    Args:
        cfg: the validated run config.
        source: architecture, tokenizer and initial weights.
        data: the data module (its state rides in the checkpoints).
        layout: the run's layout (one process included).
        metrics: ``metrics.csv`` (rank 0), or None.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        source: ModelSource,
        data: NevaDataModule,
        layout: Layout,
        metrics: MetricsCSV | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.source = source
        self.data = data
        self.layout = layout
        self.accum = layout.grad_accum
        self.metrics = metrics
        self.precision_policy = Precision.from_config(cfg.trainer.precision, cfg.model.megatron_amp_O2)
        self.engine: Engine | None = None
        self.model: NevaModel | None = None
        self._val_sums: list[torch.Tensor] = []
        self._step_start: float | None = None
        self._flops: SampleFlops | None = None
        self._train_batches: StepBatches | None = None
        self._start: dict[str, str] | None = None  # the start's path and sha256, hashed at the first save
        self.stage_step: Any = None  # the stage's own step (its spec's ``step``), None: the engine's

    # -- model ---------------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.engine is not None:
            return
        strategy = self.trainer.strategy if self._trainer is not None else None
        device = strategy.root_device if strategy is not None else torch.device(self.layout.device_type)
        # every start-time rule of the run (neva.parallel.run_rules.check_run), the meta model, this rank's parts
        # and the stage's objective (DPO's pairs replace token CE): the rehearsal's construction too
        parts = build_parts(
            self.cfg, self.source, self.layout, device, self.precision_policy, getattr(strategy, "dims", None)
        )
        self._flops = SampleFlops.of(parts.model)
        counts = parameter_counts(parts.model)
        log.info("parameters: %s", ", ".join(f"{k}={v:,}" for k, v in sorted(counts.items())))
        self.engine = build_engine(
            parts, self.cfg, self.source, self.layout, device, self.precision_policy, data=self.data
        )
        stage = stage_spec(self.cfg.stage)
        if stage.step is not None:  # the stage's own step (GRPO: rollouts, rewards, num_iterations updates)
            self.stage_step = part(stage.step)(self.cfg, self.engine, self.source, self.data, self.layout)
        self.model = self.engine.model
        self.trainable_params = counts["trainable"]

    def configure_optimizers(self):
        optimizer = build_optimizer(self.engine.named_trainable_parameters(), self.cfg.model.optim)
        scheduler = build_scheduler(optimizer, self.cfg.model.optim, self.cfg.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- data ----------------------------------------------------------------------------------------------------
    def train_dataloader(self):
        self._train_batches = StepBatches(self.data, self.accum)
        return self._train_batches

    def val_dataloader(self):
        loader = self.data.val_dataloader()
        return _Iterable(loader) if loader else loader

    # -- steps ---------------------------------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def training_step(self, micro_batches: list[MicroBatch], batch_idx: int) -> torch.Tensor | None:
        self.model.train()
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        if self.stage_step is not None:  # the stage's own step (GRPO: rollouts, rewards, num_iterations updates)
            return self._stage_training_step(optimizer, scheduler, micro_batches)
        n_tokens = self.engine.global_tokens(micro_batches)
        if n_tokens.item() == 0:
            self._skip_step(optimizer, micro_batches)
            return None
        loss, n_tokens, grad_norm = self.engine.optimizer_step(
            optimizer, micro_batches, self.cfg.trainer.gradient_clip_val, step=self.global_step, n_tokens=n_tokens
        )
        lr = optimizer.param_groups[-1]["lr"]
        scheduler.step()
        self._log_step(micro_batches, loss, n_tokens, lr, grad_norm)
        return loss

    def _stage_training_step(self, optimizer: Any, scheduler: Any, micro_batches: list[MicroBatch]) -> None:
        step = self.global_step
        metrics = self.stage_step.run(optimizer, scheduler, micro_batches, step)
        metrics["lr"] = optimizer.param_groups[-1]["lr"]
        metrics["step_time"] = time.perf_counter() - (self._step_start or time.perf_counter())
        metrics.update(self.data.skip_tracker.metrics())
        if step % max(1, self.cfg.trainer.log_every_n_steps) == 0:
            self._record(self.global_step, metrics)
        for key in ("train_loss", "reward", "kl"):
            if key in metrics and metrics[key] == metrics[key]:
                self.log("loss" if key == "train_loss" else key, metrics[key], prog_bar=True, logger=False)

    def _skip_step(self, optimizer: Any, micro_batches: list[MicroBatch]) -> None:
        """A global batch without a learned token (all its samples skipped, on every rank, so all ranks agree): no
        forward/backward and no optimizer or schedule step, since AdamW would still move the weights on its momentum.

        ``optimizer.step()`` without any gradient leaves every parameter and its AdamW state as they are (AdamW passes
        over parameters without a gradient); it is called only to advance Lightning's step counter, so ``max_steps``,
        checkpoint intervals and ``metrics.csv`` rows keep counting global batches. The row says ``skipped_step`` 1.
        """
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        log.warning(
            "step %d: no learned token in the global batch (skips so far: %s); optimizer and schedule not stepped",
            self.global_step, self.data.skip_tracker.report(),
        )  # fmt: skip
        self._log_step(micro_batches, None, torch.zeros(()), optimizer.param_groups[-1]["lr"], None)

    def _log_step(self, micro_batches, loss, n_tokens, lr, grad_norm) -> None:
        elapsed = time.perf_counter() - (self._step_start or time.perf_counter())
        dp = self.engine.dp_size
        samples = sum(int(mb.counts.num_samples) for mb in micro_batches) * dp
        # A skipped step ran no model: no tokens processed, no FLOPs.
        seq_lens = [n for mb in micro_batches for n in sample_lengths(mb)] if loss is not None else []
        tokens = sum(seq_lens) * dp
        # Tower passes: an image is one, an AnyRes image one per tile (the FLOP model's "image" unit: tower +
        # projector of num_image_tokens); pixel_values rows count both.
        images = sum(_tower_passes(mb, "image") for mb in micro_batches) * dp
        frames = sum(_tower_passes(mb, "video") for mb in micro_batches) * dp
        metrics = {
            "lr": lr,
            "skipped_step": float(loss is None),
            "learned_tokens": n_tokens.item(),
            "samples_per_sec": samples / max(elapsed, 1e-9),
            "tokens_per_sec": tokens / max(elapsed, 1e-9),
            "step_time": elapsed,
        }
        if self._train_batches is not None:
            # Share of the step's wall time spent waiting for its data (the rest: forward, backward, optimizer).
            wait = self._train_batches.take_wait()
            metrics["data_wait_fraction"] = wait / max(wait + elapsed, 1e-9)
        if self.cfg.model.data.max_tokens_per_micro_batch is not None:  # filled to a token budget: their number varies
            metrics["micro_batches"] = len(micro_batches)
        if loss is not None:
            metrics["train_loss"] = loss.item()
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        if loss is not None:
            metrics.update(self.engine.aux_metrics)  # auxiliary objectives (MoE: the routers' loss term, expert loads)
        if seq_lens:
            # Model FLOPs of the step on all ranks (the other replicas' batches taken to be like this one's).
            flops = self._flops.batch(seq_lens, images // dp, frames // dp) * dp
            metrics["flops"] = flops
            world = self.trainer.world_size if self._trainer is not None else 1
            tflops = flops / max(elapsed, 1e-9) / 1e12 / world
            metrics["tflops_per_sec_per_device"] = tflops
            name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
            peak = device_peak_tflops(name, self.cfg.cluster.peak_tflops_bf16)
            if peak:
                metrics["mfu"] = tflops / peak
        if self.source.cfg.vision is not None and self.source.cfg.vision.spec.patch_grid:
            # Every rank logs a step (skipped or not), so every rank of the group joins this all-reduce.
            metrics.update(tower_patch_metrics(micro_batches, self.engine.dp_group, self.engine.device))
        metrics.update(self.data.skip_tracker.metrics())
        step = self.global_step
        if loss is None or step % max(1, self.cfg.trainer.log_every_n_steps) == 0:
            self._record(step, metrics)
        if loss is not None:
            self.log("loss", metrics["train_loss"], prog_bar=True, logger=False)
            for key in self.engine.headline_metrics:
                if key in metrics:
                    self.log(key, metrics[key], prog_bar=True, logger=False)
        self.log("samples/s", metrics["samples_per_sec"], prog_bar=True, logger=False)

    def validation_step(self, batch: MicroBatch, batch_idx: int) -> None:
        self.model.eval()
        if self.stage_step is not None:  # the stage's held-out metrics (GRPO: prompts answered and scored)
            self.stage_step.held_out(batch)
            return
        loss, n_tokens = self.engine.evaluate([batch])
        self._val_sums.append(torch.stack([loss * n_tokens, n_tokens]))

    def on_validation_epoch_end(self) -> None:
        if self.stage_step is not None:
            held_out = self.stage_step.held_out_metrics()
            self.log("val_reward", held_out["val_reward"], prog_bar=True, logger=False, rank_zero_only=True)
            if not self.trainer.sanity_checking:
                self._record(self.global_step, held_out)
            return
        if not self._val_sums:
            return
        total = torch.stack(self._val_sums).sum(0)
        self._val_sums.clear()
        val_loss = (total[0] / total[1].clamp(min=1)).item()
        held_out = self.engine.held_out_metrics()  # the objectives' (the preference stage's held-out rewards)
        self.log("val_loss", val_loss, prog_bar=True, logger=False, rank_zero_only=True)
        if not self.trainer.sanity_checking:
            self._record(self.global_step, {"val_loss": val_loss, **held_out})

    def record_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """``_record`` for callbacks (evaluation during training: ``neva.training.eval_hook``)."""
        self._record(step, metrics)

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        """One row of ``metrics.csv`` and the same values at the same step in every logger (TensorBoard, W&B).

        Not through ``self.log``: Lightning's logger connector would log at the count of steps *before* this one and
        by its own ``log_every_n_steps`` rule, so TensorBoard's steps would be one less than ``metrics.csv``'s.
        """
        if self.metrics is not None:
            self.metrics.record(step, metrics)
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=step)  # rank zero only (Lightning's loggers)

    # -- checkpoint extras ---------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The data position is saved by Lightning through the loader (StepBatches.state_dict).
        checkpoint["rng"] = {
            "torch": torch.get_rng_state(),
            "numpy": numpy_rng_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }
        if self.engine.master is not None:
            checkpoint["master_weights"] = {n: p.detach().clone() for n, p in self.engine.master.named_master}
        checkpoint[CONFIG_KEY] = config_record(self.cfg)
        # Export / serving of this step read the same start from anywhere. Hashed once, on the rank that writes the
        # checkpoint's plain entries (a one-process file, a DCP meta.pt): the others' copies are not saved.
        writer = self._trainer is None or self.trainer.is_global_zero
        if self._start is None and self.source.checkpoint is not None and writer:
            self._start = start_record(self.source.checkpoint)
        checkpoint[START_KEY] = self._start
        # Lightning stores optimizer state by position; the names let another layout find each parameter's state.
        names = {id(p): n for n, p in self.engine.named_trainable_parameters()}
        groups = self.trainer.optimizers[0].param_groups if self.trainer.optimizers else []
        checkpoint["optimizer_param_names"] = [[names[id(p)] for p in g["params"]] for g in groups]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "neva_data" in checkpoint:  # written before the loader carried the data state
            self.data.load_state_dict(checkpoint["neva_data"])
        rng = checkpoint.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            set_numpy_rng_state(rng["numpy"])
            random.setstate(rng["python"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def check_resume(self, checkpoint: dict[str, Any], path: Any) -> None:
        """Called by the strategy with a checkpoint's loop state before any of its tensors is loaded: refuses config
        changes that alter what is trained and logs the applied ones (``neva.training.resume_check``)."""
        check_resume(checkpoint, self.cfg, path, log_changes=self._trainer is None or self.trainer.is_global_zero)

    def on_train_start(self) -> None:
        if self.metrics is not None:
            self.metrics.truncate_after(self.global_step)


def _tower_passes(mb: MicroBatch, modality: str) -> int:
    return 0 if mb.media is None else mb.media.tower_inputs(modality)
