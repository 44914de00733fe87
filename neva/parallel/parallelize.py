"""``parallelize``: from the meta model to this rank's runnable parts, for every world size including one process.

Order (torchtitan's): pipeline split → tensor/sequence parallel → activation checkpointing → compile → FSDP2/DDP →
master weights. A plan whose size is 1 is simply not applied, so one process runs the same function.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from neva.checkpoint.initial_weights import init_fresh, load_source_weights
from neva.checkpoint.names import named_parameters
from neva.checkpoint.source import ModelSource
from neva.config import ModelConfig
from neva.models.lora import merged_state_dict
from neva.models.neva import NevaModel
from neva.parallel.compute_plans import apply_compute_plans
from neva.parallel.data_parallel import all_reduce_gradients, apply_fsdp, ddp_sync_context, fsdp_sync_context
from neva.parallel.expert_parallel import apply_expert_parallel, is_expert_param
from neva.parallel.layout import Layout
from neva.parallel.mesh import DP_CP, ParallelDims, build_mesh
from neva.parallel.pipeline import PipelineRunner, build_chunks, local_chunks, split_layers
from neva.parallel.precision import MasterWeights, Precision, cast_parameters
from neva.parallel.stage_owners import chunk_of_key
from neva.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_logits
from neva.typed import ConfigError

log = logging.getLogger(__name__)


def _no_sync(is_last: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class ParallelModel:
    """This rank's share of the model and how to run it.

    Attributes:
        parts: this rank's NevaModel chunks (one unless interleaved pipelining); parameter names are the whole
            model's.
        layout: the run's layout; dims: its device mesh (None in one process).
        forward_model: what the micro-batch loop calls (a DDP wrapper or ``parts[0]``); unused with pipelining.
        sync_context: ``sync_context(is_last)`` is entered around each micro-batch's backward; data-parallel wrappers
            reduce gradients only in the last one.
        runner: the pipeline schedule runner, or None.
        master: fp32 master weights of bf16 parameters (O2 without FSDP2, whose sharded parameters are the masters).
        vocab_parallel: the logits are vocab-sharded DTensors (the loss runs under ``loss_parallel``).
        manual_dp_sync: all-reduce gradients over data-parallel ranks after backward (DDP semantics where torch's
            DDP cannot wrap the model: TP or PP layouts).
        export_keys: ``{plain key: shape}`` of the consolidated (LoRA-merged) model, in state-dict order.
        key_stage: pipeline rank owning each export key.
    """

    parts: list[NevaModel]
    layout: Layout
    dims: ParallelDims | None
    forward_model: nn.Module
    sync_context: Callable[[bool], contextlib.AbstractContextManager] = _no_sync
    runner: PipelineRunner | None = None
    master: MasterWeights | None = None
    vocab_parallel: bool = False
    manual_dp_sync: bool = False
    export_keys: dict[str, torch.Size] = field(default_factory=dict)
    key_stage: dict[str, int] = field(default_factory=dict)

    def all_reduce_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """``manual_dp_sync``'s reduction: gradients averaged over dp × cp, an expert tensor's over its replicas
        (edp)."""
        params = list(params)
        experts = [p for p in params if is_expert_param(p)]
        all_reduce_gradients([p for p in params if not is_expert_param(p)], self.grad_group)
        if experts and self.dims.expert_mesh["edp"].size() > 1:
            all_reduce_gradients(experts, self.dims.expert_mesh["edp"].get_group())

    @property
    def grad_group(self):
        """The group gradients are reduced over: dp, or dp × cp with context parallelism (None: one rank)."""
        return self.group(DP_CP if self.layout.cp > 1 else "dp")

    def group(self, dim: str):
        """The process group of mesh dimension ``dim``, or None when that dimension has size 1."""
        if self.dims is None or getattr(self.layout, dim) == 1:
            return None
        return self.dims.group(dim)


def uses_fsdp(layout: Layout, precision: Precision) -> bool:
    """FSDP2 wraps the model when data-parallel replicas shard it, and under O2 in distributed runs (its
    mixed-precision policy keeps the sharded fp32 parameters as master weights)."""
    return layout.data_parallel == "fsdp" and (layout.dp_cp > 1 or (precision.master_weights and layout.is_distributed))


def check_precision_layout(layout: Layout, precision: Precision) -> None:
    """O2 in a distributed run keeps its fp32 masters in FSDP2's sharded parameters, so it needs ``fsdp``
    (``neva.parallel.run_rules.check_run`` asks it).

    Raises:
        ConfigError: O2 with DDP in a distributed run.
    """
    if precision.master_weights and layout.is_distributed and layout.data_parallel == "ddp":
        raise ConfigError(
            "model.megatron_amp_O2=true keeps fp32 master weights through FSDP2's mixed-precision policy; use "
            "model.data_parallel=fsdp (the default) with O2"
        )


def parallelize(
    meta_model: NevaModel,
    source: ModelSource,
    layout: Layout,
    m: ModelConfig,
    device: torch.device,
    precision: Precision,
    dims: ParallelDims | None = None,
    allocation: contextlib.AbstractContextManager | None = None,
) -> ParallelModel:
    """Materialise and parallelize ``meta_model`` (built by ``neva.models.trainable.build_meta_model``) for this rank.

    Args:
        meta_model: the whole model on the meta device with its trainable policy applied.
        source: initial weights (fresh init, a neva checkpoint or HF weights).
        layout: the run's layout.
        m: ``model.*`` (seed, ``meta_init``, compile, packing).
        device: this rank's device.
        precision: fp32, bf16 autocast or bf16 O2.
        dims: the device mesh the strategy built (distributed runs build one here when None).
        allocation: a context every allocation of this rank's tensors runs under, entered after the plans are
            applied on the meta device (needs ``m.meta_init``). The full-size rehearsal
            (``neva.training.rehearsal``) passes its ``FakeTensorMode`` here; training passes nothing.

    The run's start-time rules are not asked here: its caller asks ``neva.parallel.run_rules.check_run`` first
    (training, the rehearsal, the benchmark); a preference run's frozen reference, which trains nothing, is built by
    this same function. The plans guard their own preconditions (``apply_tensor_parallel``, ``build_chunks``, the
    pipeline runner) with the same rules.
    """
    if m.sequence_parallel and layout.tp == 1:
        log.warning("model.sequence_parallel=true has no effect without tensor parallelism")
    if layout.is_distributed and dims is None:
        dims = build_mesh(layout)
    export_keys = {k: v.shape for k, v in merged_state_dict(meta_model).items() if not k.endswith("inv_freq")}
    layer_split = split_layers(meta_model.cfg.llm.num_layers, layout.num_chunks, layout.first_stage_layers)
    key_stage = {k: chunk_of_key(k, layer_split) % layout.pp for k in export_keys}
    # The default materialises the whole model first, so every layout starts from bit-identical weights (what the
    # equivalence tests compare); meta_init never holds the whole model on a rank (models too large for one).
    if not m.meta_init:
        init_fresh(meta_model, device, m.seed)
        load_source_weights([meta_model], source)
    if layout.pp > 1:
        chunk_ids = local_chunks(dims.pp_rank, layout.pp, layout.vpp)
        parts = build_chunks(meta_model, dims.pp_rank, layout.pp, layout.vpp, layout.first_stage_layers)
    else:
        chunk_ids, parts = [0], [meta_model]
    vocab_parallel = vocab_parallel_logits(layout.tp, layout.pp)
    for part in parts:
        if layout.tp > 1:
            apply_tensor_parallel(part, dims.tp_mesh, layout.sp, vocab_parallel)
        if layout.ep > 1:
            apply_expert_parallel(part, dims.expert_mesh["ep"])
        apply_compute_plans(part, m, device)
    fsdp = uses_fsdp(layout, precision)
    out = ParallelModel(
        parts, layout, dims, parts[0], vocab_parallel=vocab_parallel, export_keys=export_keys, key_stage=key_stage
    )
    if fsdp:
        param_dtype = precision.param_dtype if precision.master_weights else None
        for part in parts:
            apply_fsdp(part, dims.grad_mesh, param_dtype, reshard=layout.zero_stage == 3, expert_mesh=dims.expert_mesh)
        out.sync_context = fsdp_sync_context(parts)
    if allocation is not None and not m.meta_init:
        raise ValueError("parallelize(allocation=...) needs model.meta_init=true (plans are applied on meta first)")
    with allocation or contextlib.nullcontext():
        _materialize(out, parts, chunk_ids, source, layout, m, device, precision, fsdp)
    return out


def _materialize(
    out: ParallelModel,
    parts: list[NevaModel],
    chunk_ids: list[int],
    source: ModelSource,
    layout: Layout,
    m: ModelConfig,
    device: torch.device,
    precision: Precision,
    fsdp: bool,
) -> None:
    """The allocating tail of ``parallelize``: weights (meta_init), DDP, O2 master weights, the pipeline runner."""
    dims = out.dims
    if m.meta_init:
        # Only this rank's shards are allocated: fresh init shard by shard (statistically the same init, not
        # bit-identical to one process), then checkpoint / HF tensors read one at a time, each rank copying its slice.
        for part in parts:
            init_fresh(part, device, m.seed)
        load_source_weights(parts, source)
    if not fsdp and layout.dp_cp > 1:
        if layout.tp == 1 and layout.pp == 1 and layout.ep == 1:
            out.forward_model = nn.parallel.DistributedDataParallel(
                parts[0], process_group=out.grad_group, device_ids=[device.index] if layout.is_cuda else None
            )
            out.sync_context = ddp_sync_context(out.forward_model)
        else:
            out.manual_dp_sync = True
    if precision.master_weights and not fsdp:
        out.master = MasterWeights([(n, p) for n, p in named_parameters(parts) if p.requires_grad])
        for part in parts:
            cast_parameters(part, precision.param_dtype)
    if layout.pp > 1:
        autocast = None
        if precision.autocast_dtype is not None:
            autocast = lambda: torch.autocast(device.type, dtype=precision.autocast_dtype)  # noqa: E731
        out.runner = PipelineRunner(
            parts, chunk_ids, layout.num_chunks, dims.group("pp"), device, layout.schedule,
            n_microbatches=layout.grad_accum, packed=m.data.packing, autocast=autocast, dp_group=out.group("dp"),
        )  # fmt: skip
