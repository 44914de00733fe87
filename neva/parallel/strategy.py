"""The Lightning strategy of distributed runs: one ``("pp", "dp", "tp")`` mesh, DCP checkpoints.

Built on Lightning's ``ModelParallelStrategy`` (process launch under torchrun / SLURM / Lightning's own launcher,
process-group setup, ``configure_model`` hook), with its 2-D mesh replaced by neva's 3-D one and its checkpoint
format replaced by ``neva.checkpoint.dcp`` (layout-independent keys, so a run may resume under another layout).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.utilities.load import _METADATA_FILENAME
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.strategies import ModelParallelStrategy

from neva.checkpoint import dcp
from neva.parallel.mesh import ParallelDims, build_mesh
from neva.training.config import TrainConfig
from neva.training.strategy import Layout, restore_schedules


class NevaParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with the ``("pp", "dp", "tp")`` mesh; gloo without GPUs, NCCL with them.

    Args:
        layout: the resolved process layout.
        use_cuda: one GPU per process (NCCL) instead of CPU processes (gloo).
    """

    def __init__(self, layout: Layout, use_cuda: bool) -> None:
        super().__init__(
            data_parallel_size=layout.dp,
            tensor_parallel_size=layout.tp,
            save_distributed_checkpoint=True,
            process_group_backend="nccl" if use_cuda else "gloo",
        )
        self.layout = layout
        self.dims: ParallelDims | None = None
        if not use_cuda:
            self._accelerator = CPUAccelerator()

    def setup_environment(self) -> None:
        self._setup_distributed()
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        if self.world_size != self.layout.world:
            raise RuntimeError(f"launched {self.world_size} processes but the layout needs {self.layout.world}")
        self.dims = build_mesh(self.layout, self.root_device.type)
        self._device_mesh = self.dims.mesh
        self.lightning_module._device_mesh = self.dims.mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp, "rank": self.dims.dp_rank if self.dims else 0}

    # -- checkpoints: DCP shards of the engine's parts + Lightning's loop state in meta.pt ------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights go through dcp.save in save_checkpoint

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def _engine_state(self) -> tuple[list, torch.optim.Optimizer | None]:
        engine = self.lightning_module.engine
        optimizer = self.optimizers[0] if self.optimizers else None
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return engine.parts, optimizer

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero:
            if path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)  # a stale copy would mix old shard files with new metadata
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        parts, optimizer = self._engine_state()
        dcp.save(path, parts, optimizer)
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        if self.is_global_zero:
            torch.save(checkpoint, path / _METADATA_FILENAME)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        parts, optimizer = self._engine_state()
        dcp.load(path, parts, optimizer)
        checkpoint = torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=False)
        restore_schedules(self.lightning_module.trainer, checkpoint)
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def build_distributed_strategy(cfg: TrainConfig, layout: Layout) -> NevaParallelStrategy:
    """The strategy for ``layout`` (called by ``neva.training.strategy.build_strategy`` when world > 1)."""
    from neva.training.strategy import _use_cuda

    return NevaParallelStrategy(layout, use_cuda=_use_cuda(cfg))
