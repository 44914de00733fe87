"""``make_parallelize``: turn the meta model into this rank's parallelized parts and a ``ParallelEngine``.

Order (torchtitan's): pipeline split → tensor/sequence parallel → activation checkpointing → compile → FSDP2/DDP.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from neva.checkpoint.dcp import canonical_name, named_parameters
from neva.models.lora import LoRALinear
from neva.models.neva import NevaModel
from neva.parallel import mesh as mesh_lib
from neva.parallel.checkpointing import apply_compute_plans
from neva.parallel.data_parallel import all_reduce_gradients, apply_fsdp, ddp_sync_context, fsdp_sync_context
from neva.parallel.materialize import materialize_parts, materialize_sharded
from neva.parallel.pipeline import PipelineRunner, build_chunks, chunk_of_key, local_chunks, split_layers
from neva.parallel.tensor_parallel import apply_tensor_parallel, check_divisibility
from neva.training.build import ModelSource
from neva.training.config import TrainConfig
from neva.training.engine import Engine
from neva.training.precision import Precision
from neva.training.strategy import Layout
from neva.typed import ConfigError

log = logging.getLogger(__name__)


class ParallelEngine(Engine):
    """``Engine`` over this rank's parts of a (TP / SP / PP / FSDP2 / DDP) parallelized model.

    Args:
        parts: this rank's NevaModel chunks (one unless interleaved pipelining); parameter names are the whole
            model's.
        dims: the device mesh.
        forward_model: what the micro-batch loop calls (a DDP wrapper or ``parts[0]``); unused with pipelining.
        runner: the pipeline schedule runner, or None.
        vocab_parallel: the logits are vocab-sharded DTensors (compute the loss under ``loss_parallel``).
        manual_dp_sync: all-reduce gradients over data-parallel ranks after backward (DDP semantics where torch's
            DDP cannot wrap the model).
        sp_multiple: pad sequences to a multiple of this (sequence parallelism splits them over tp ranks).
        full_keys: ``{plain key: (shape, dtype)}`` of the consolidated model, for export.
        key_stage: pipeline rank owning each consolidated key.
    """

    def __init__(
        self,
        parts: list[NevaModel],
        dims: mesh_lib.ParallelDims,
        precision: Precision,
        device: torch.device,
        forward_model: nn.Module,
        runner: PipelineRunner | None,
        vocab_parallel: bool,
        manual_dp_sync: bool,
        sync_context: Callable[[bool], contextlib.AbstractContextManager] | None,
        packed: bool,
        sp_multiple: int,
        full_keys: dict[str, tuple[torch.Size, torch.dtype]],
        key_stage: dict[str, int],
    ) -> None:
        layout = dims.layout
        super().__init__(
            forward_model,
            precision,
            device,
            dp_group=dims.group("dp") if layout.dp > 1 else None,
            sync_context=sync_context,
            forward_backward_fn=self._pipeline_step if runner is not None else None,
            packed=packed,
        )
        self.parts = parts
        self.dims = dims
        self.runner = runner
        self.vocab_parallel = vocab_parallel
        # Selecting positions of a (sequence-)sharded activation would need a collective; keep full logits there.
        self.learned_only_head = layout.tp == 1
        self.manual_dp_sync = manual_dp_sync
        self.sp_multiple = sp_multiple
        self.full_keys = full_keys
        self.key_stage = key_stage
        if len(parts) > 1:
            self.model = nn.ModuleList(parts)  # for train()/eval() and device moves; names via ``parts``

    # -- what the optimizer sees -------------------------------------------------------------------------------
    def named_trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in named_parameters(self.parts) if p.requires_grad]

    # -- compute -----------------------------------------------------------------------------------------------
    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.vocab_parallel else contextlib.nullcontext()

    def _pad(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.sp_multiple <= 1 or batch["input_ids"].shape[1] % self.sp_multiple == 0:
            return batch
        from neva.parallel.pipeline import pad_micro_batches

        return pad_micro_batches([batch], self.sp_multiple)[0]

    def loss_sum(self, batch: dict[str, Any]) -> torch.Tensor:
        batch = self._pad(batch)
        loss = super().loss_sum(batch)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def _pipeline_step(self, micro_batches: list[dict[str, Any]], scale: torch.Tensor) -> torch.Tensor:
        return self.runner.forward_backward(micro_batches, scale, self.sp_multiple)

    def forward_backward(self, micro_batches: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        with self._loss_context():
            out = super().forward_backward(micro_batches)
        if self.manual_dp_sync and self.dp_group is not None:
            all_reduce_gradients((p for _, p in self.named_trainable_parameters()), self.dp_group)
        return out

    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.runner is not None:
            total = self.runner.evaluate(micro_batches, self.sp_multiple)
            n_tokens = self.global_tokens(micro_batches)
            if self.dp_group is not None:
                dist.all_reduce(total, group=self.dp_group)
            return total / n_tokens.clamp(min=1.0), n_tokens
        with self._loss_context():
            return super().evaluate(micro_batches)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the global norm over every rank's shards (tensor, data and pipeline parallel)."""
        grads = [p.grad for p in self.grad_params()]
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for g in grads:
            n = torch.linalg.vector_norm(g.float())
            if isinstance(n, DTensor):
                n = n.full_tensor()
            sq += n.float() ** 2
        if self.dims.layout.pp > 1:
            dist.all_reduce(sq, group=self.dims.group("pp"))
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype) if not isinstance(g, DTensor) else coef.item())
        return float(norm)

    # -- export ------------------------------------------------------------------------------------------------
    def _local_full_tensors(self) -> dict[str, Callable[[], torch.Tensor]]:
        """Plain key → function gathering the full tensor (a collective over this stage's dp × tp ranks)."""

        def full(t: torch.Tensor) -> torch.Tensor:
            return t.full_tensor() if isinstance(t, DTensor) else t

        out: dict[str, Callable[[], torch.Tensor]] = {}
        for part in self.parts:
            lora = {canonical_name(n): m for n, m in part.named_modules() if isinstance(m, LoRALinear)}
            for name, p in named_parameters([part]):
                owner = next((k for k in lora if name.startswith(k + ".")), None)
                if owner is None:
                    out[name] = lambda p=p: full(p.data)
                elif name == f"{owner}.base.weight":
                    m = lora[owner]
                    out[f"{owner}.weight"] = lambda m=m: (
                        full(m.base.weight.data).float()
                        + m.scale * full(m.lora_b.weight.data).float() @ full(m.lora_a.weight.data).float()
                    )
                elif name.startswith(f"{owner}.base."):
                    out[f"{owner}.{name[len(owner) + 6 :]}"] = lambda p=p: full(p.data)
        return out

    def full_state_dict_iter(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Consolidated fp32 tensors, one at a time, on global rank 0 (every rank must iterate along)."""
        local = self._local_full_tensors()
        rank = dist.get_rank()
        my_stage = self.dims.pp_rank
        stage_size = self.dims.layout.dp * self.dims.layout.tp
        for key, (shape, _) in self.full_keys.items():
            stage = self.key_stage[key]
            tensor = None
            if stage == my_stage:
                tensor = local[key]().detach().float()
            if stage != 0:
                sender = stage * stage_size
                if rank == sender:
                    dist.send(tensor.contiguous().to(self.device), dst=0)
                elif rank == 0:
                    tensor = torch.empty(shape, dtype=torch.float32, device=self.device)
                    dist.recv(tensor, src=sender)
            yield key, tensor.cpu() if rank == 0 else None


def _export_keys(meta_model: NevaModel) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Consolidated (LoRA-merged, plain) keys of the whole model, in state-dict order."""
    from neva.models.lora import merged_state_dict

    return {k: (v.shape, v.dtype) for k, v in merged_state_dict(meta_model).items() if not k.endswith("inv_freq")}


def make_parallelize(cfg: TrainConfig, layout: Layout):
    """``parallelize(meta_model, source, device, precision) -> ParallelEngine`` for ``NevaModule.configure_model``."""
    m = cfg.model
    if precision_master(cfg) and m.data_parallel == "ddp":
        raise ConfigError(
            "model.megatron_amp_O2=true keeps fp32 master weights through FSDP2's mixed-precision policy; use "
            "model.data_parallel=fsdp (the default) with O2"
        )
    if m.sequence_parallel and layout.tp == 1:
        log.warning("model.sequence_parallel=true has no effect without tensor parallelism")
    virtual = m.virtual_pipeline_model_parallel_size or 1
    schedule = m.pipeline_schedule
    if virtual > 1 and schedule == "1f1b":
        schedule = "interleaved_1f1b"  # NeMo: a virtual pipeline size selects the interleaved schedule

    def parallelize(meta_model: NevaModel, source: ModelSource, device: torch.device, precision: Precision):
        dims = mesh_lib.current(layout, device.type)
        if layout.tp > 1:
            check_divisibility(meta_model.cfg, layout.tp)
        full_keys = _export_keys(meta_model)
        num_chunks = layout.pp * virtual
        layer_split = split_layers(meta_model.cfg.llm.num_layers, num_chunks, m.pipeline_first_stage_layers)
        key_stage = {k: chunk_of_key(k, layer_split) % layout.pp for k in full_keys}
        # Sharded init never holds the whole model on a rank; the default materialises it whole first so that every
        # layout starts from bit-identical weights (what the equivalence tests compare).
        sharded_init = m.meta_init
        model = meta_model if sharded_init else materialize_parts(meta_model, source, device, cfg.model.seed)
        if layout.pp > 1:
            chunk_ids = local_chunks(dims.pp_rank, layout.pp, virtual)
            parts = build_chunks(model, dims.pp_rank, layout.pp, virtual, m.pipeline_first_stage_layers)
        else:
            chunk_ids, parts = [0], [model]
        sp = m.sequence_parallel and layout.tp > 1
        vocab_parallel = layout.tp > 1 and layout.pp == 1
        for part in parts:
            if layout.tp > 1:
                apply_tensor_parallel(part, dims.tp_mesh, sp, vocab_parallel)
            apply_compute_plans(part, m)
        use_fsdp = m.data_parallel == "fsdp" and (layout.dp > 1 or precision.master_weights)
        sync_context = None
        forward_model: nn.Module = parts[0]
        manual_dp_sync = False
        if use_fsdp:
            param_dtype = precision.param_dtype if precision.master_weights else None
            for part in parts:
                apply_fsdp(part, dims.dp_mesh, param_dtype, reshard=m.zero_stage == 3)
            sync_context = fsdp_sync_context(parts)
        if sharded_init:
            materialize_sharded(parts, source, device, cfg.model.seed)
        if not use_fsdp and layout.dp > 1:
            if layout.tp == 1 and layout.pp == 1:
                forward_model = nn.parallel.DistributedDataParallel(
                    parts[0],
                    process_group=dims.group("dp"),
                    device_ids=[device.index] if device.type == "cuda" else None,
                )
                sync_context = ddp_sync_context(forward_model)
            else:
                manual_dp_sync = True
        runner = None
        if layout.pp > 1:
            autocast = None
            if precision.autocast_dtype is not None:
                autocast = lambda: torch.autocast(device.type, dtype=precision.autocast_dtype)  # noqa: E731
            runner = PipelineRunner(
                parts, chunk_ids, num_chunks, dims.group("pp"), device, schedule,
                n_microbatches=m.global_batch_size // (m.micro_batch_size * layout.dp),
                packed=m.data.packing, autocast=autocast,
            )  # fmt: skip
        return ParallelEngine(
            parts, dims, precision, device, forward_model, runner,
            vocab_parallel=vocab_parallel, manual_dp_sync=manual_dp_sync, sync_context=sync_context,
            packed=m.data.packing, sp_multiple=layout.tp if sp else 1, full_keys=full_keys, key_stage=key_stage,
        )  # fmt: skip

    return parallelize


def precision_master(cfg: TrainConfig) -> bool:
    return bool(cfg.model.megatron_amp_O2)
