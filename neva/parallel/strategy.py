"""The Lightning strategies: one process, or one ``("pp", "dp", "cp", "tp")`` mesh of processes; checkpoint I/O for both.

One process writes Lightning checkpoint files; distributed runs write DCP directories (``neva.checkpoint.dcp``) under
the whole model's parameter names. Both strategies read both: a DCP directory through ``load_dcp`` (each rank reads the
pieces its shards need), a one-process file through ``load_whole`` (each rank slices the full tensors by name), so a
run may continue under any other layout (and precision: a one-process O2 run keeps fp32 masters of the trained
weights, which both readers prefer). Either way the optimizer's hyperparameters are this run's and the learning rate
is recomputed from the saved step and this run's schedule (``restore_schedules``), whoever wrote the checkpoint; the
module compares the config recorded in the checkpoint with this run's before any tensor is copied
(``check_resume``).
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.utilities.load import _METADATA_FILENAME
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.strategies import ModelParallelStrategy, SingleDeviceStrategy, Strategy

from neva.checkpoint import dcp, verified
from neva.checkpoint.initial_weights import copy_full
from neva.checkpoint.step import whole_weights
from neva.parallel.elastic_restart import init_restarted_group
from neva.parallel.layout import Layout
from neva.parallel.mesh import ParallelDims, build_mesh


def build_strategy(layout: Layout, timeout: timedelta | None = None) -> Strategy:
    """The strategy for ``layout``; ``timeout`` bounds every collective (``model.distributed_timeout_minutes``)."""
    if layout.is_distributed:
        return NevaParallelStrategy(layout, timeout)
    return NevaSingleDeviceStrategy(torch.device("cuda", 0) if layout.is_cuda else torch.device("cpu"))


def _engine_state(strategy: Strategy) -> tuple[list, torch.optim.Optimizer | None]:
    """The named parameters and the (unwrapped) optimizer a checkpoint holds."""
    optimizer = strategy.optimizers[0] if strategy.optimizers else None
    return strategy.lightning_module.engine.checkpoint_parameters(), getattr(optimizer, "_optimizer", optimizer)


def load_dcp(strategy: Strategy, path: Path) -> dict[str, Any]:
    """Fill the engine's parts and optimizer from DCP directory ``path`` (any layout wrote it) and return the loop
    state, with the schedulers' learning rates recomputed for this layout."""
    checkpoint = verified.load_state(path / _METADATA_FILENAME)  # the small file first: refused before any shard
    strategy.lightning_module.check_resume(checkpoint, path)
    named, optimizer = _engine_state(strategy)
    dcp.load(path, named, optimizer)
    _publish_masters(strategy)
    restore_schedules(strategy.lightning_module.trainer, checkpoint)
    return checkpoint


def load_whole(strategy: Strategy, path: Path) -> dict[str, Any]:
    """Fill the engine's (sharded) parts and optimizer from a one-process checkpoint file and return the loop state.

    Every rank reads the file and copies its own slice of each full tensor, by parameter name: trained weights from
    the fp32 master copies when the run was O2, optimizer state through the names saved with it.
    """
    checkpoint = verified.load_state(path)
    strategy.lightning_module.check_resume(checkpoint, path)
    named, optimizer = _engine_state(strategy)
    weights = whole_weights(checkpoint)
    for name, p in named:
        if name not in weights:
            raise KeyError(f"{path} has no tensor {name!r}: it was written for another model")
        copy_full(p.data, weights[name], name, path)
    saved = checkpoint.pop("optimizer_states")[0]
    names = checkpoint.get("optimizer_param_names")
    if optimizer is not None and names is None:
        raise ValueError(f"{path} does not name its optimizer's parameters; resume it with the layout that wrote it")
    if optimizer is not None:
        dcp.init_optimizer_state(optimizer)
        order = [n for group in names for n in group]
        state = {order[i]: value for i, value in saved["state"].items()}
        for name, p in strategy.lightning_module.engine.named_trainable_parameters():
            for key, value in state.get(name, {}).items():
                copy_full(optimizer.state[p][key], value, f"{name}.{key}", path)
    _publish_masters(strategy)
    restore_schedules(strategy.lightning_module.trainer, checkpoint)
    return checkpoint


def _publish_masters(strategy: Strategy) -> None:
    """One-process O2: the bf16 parameters follow the fp32 masters just loaded (from an O2 run's masters, or from an
    fp32 run's weights, so a precision change keeps the trained weights)."""
    engine = strategy.lightning_module.engine
    if engine.master is not None:
        engine.master.publish()


def restore_schedules(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Keep only the step count of saved schedulers and recompute this rank's learning rates from it.

    A pipeline stage may hold other parameter groups than rank 0 (which wrote the metadata), and a new layout may
    differ again, so the saved per-group lists cannot be loaded as they are.
    """
    saved = checkpoint.get("lr_schedulers", [])
    for i, (config, state) in enumerate(zip(trainer.lr_scheduler_configs, saved)):
        scheduler = config.scheduler
        last = state["last_epoch"]
        fresh = scheduler.state_dict()
        fresh.update(last_epoch=last, _step_count=state.get("_step_count", last + 1))
        lrs = [base * fn(last) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        fresh["_last_lr"] = lrs
        set_lrs(scheduler.optimizer, lrs)
        saved[i] = fresh


def set_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> None:
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


class NevaSingleDeviceStrategy(SingleDeviceStrategy):
    """One process. It reads its own checkpoint files the way distributed ranks do (``load_whole``: by parameter
    name, O2 masters preferred, this run's optimizer hyperparameters), so a resume may change the precision or the
    optimizer's parameter groups, and it resumes the DCP checkpoint directories of distributed runs (DCP gathers the
    shards of any layout into this process's full tensors)."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the loaders fill the optimizer's state, which exists only after setup

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        return load_dcp(self, path) if path.is_dir() else load_whole(self, path)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the loaders already filled the optimizer state in place

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # the loaders already filled the weights

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # filled by the loaders by parameter name, under this run's parameter groups and hyperparameters


class NevaParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (process launch under torchrun / SLURM / Lightning's own launcher,
    process-group setup, the ``configure_model`` hook) with neva's ``("pp", "dp", "cp", "tp")`` mesh in place of its 2-D one
    and DCP checkpoints under layout-independent keys; gloo without GPUs, NCCL with them. ``timeout`` (default:
    Lightning's, 30 min) bounds the collectives of the default group and of every mesh group."""

    def __init__(self, layout: Layout, timeout: timedelta | None = None) -> None:
        super().__init__(
            data_parallel_size=layout.dp,
            tensor_parallel_size=layout.tp,
            save_distributed_checkpoint=True,
            process_group_backend="nccl" if layout.is_cuda else "gloo",
            **({"timeout": timeout} if timeout is not None else {}),
        )
        self.layout = layout
        self.dims: ParallelDims | None = None
        if not layout.is_cuda:
            self._accelerator = CPUAccelerator()

    def setup_environment(self) -> None:
        # A group restarted by `torchrun --max-restarts` needs a fresh store namespace (Lightning's rendezvous, run by
        # _setup_distributed, then sees the group initialised and keeps it).
        init_restarted_group(self._process_group_backend, self._timeout, self.root_device)
        self._setup_distributed()
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        if self.world_size != self.layout.world:
            raise RuntimeError(f"launched {self.world_size} processes but the layout needs {self.layout.world}")
        self.dims = build_mesh(self.layout, self._timeout)
        self._device_mesh = self.dims.mesh
        self.lightning_module._device_mesh = self.dims.mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp, "rank": self.dims.dp_rank if self.dims else 0}

    # -- checkpoints: DCP shards of the engine's parts + Lightning's loop state in the metadata file ---------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights go through dcp.save in save_checkpoint

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero:
            verified.remove_manifest(path)  # first: an interrupted save must not leave the old manifest in place
            if path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)  # a stale copy would mix old shard files with new metadata
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        named, optimizer = _engine_state(self)
        digests = dcp.save(path, named, optimizer)
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        if self.is_global_zero:
            digests[_METADATA_FILENAME] = verified.save_hashed(checkpoint, path / _METADATA_FILENAME)
        every = [None] * self.world_size
        dist.all_gather_object(every, digests)
        if self.is_global_zero:  # the manifest last: only now is every rank's part on disk
            verified.write_manifest(path, {k: v for d in every for k, v in d.items()}, checkpoint["global_step"])
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        return load_dcp(self, path) if path.is_dir() else load_whole(self, path)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            verified.remove_manifest(path)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
