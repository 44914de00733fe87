"""Full-size rehearsal: one real optimizer step of a layout's rank, at real size, on fake tensors, on this CPU.

For each distinct rank role of the layout (every pipeline stage; TP and DP ranks are symmetric, so the stage's
``(dp 0, cp 0, tp 0)`` rank stands for them: it holds the largest ``torch.chunk`` pieces; for cp rank 0 see
``rank_roles``) the run's own path is executed: training's start (``check_run``'s rules, ``build_meta_model``) →
``parallelize`` → ``Engine`` with the run's precision, O2 bookkeeping, activation checkpointing, sequence length and
micro-batches, then gradient clipping and the AdamW step — under
``FakeTensorMode`` (tensors carry shapes, dtypes and storage sizes, no data) and torch's fake process group (every
collective returns at once). torch's memory trackers (``FSDPMemTracker``, ``MemTracker``) count every storage the
step allocates, so the result is the rank's peak tensor memory and its split by category, with the place in the step
where the peak falls. A layout the code cannot run fails here with the code's own exception.

Why it lives in ``training/``: it runs training's ``Engine`` and optimizer, and the planner (a sibling package) must not
import training; ``neva.plan`` (an entry point) puts the two side by side.

What it cannot see (the planner's ``memory_overhead_gb`` covers them): the CUDA context, NCCL and cuBLAS workspaces,
allocator fragmentation and rounding. It runs the CPU code path at the real shapes (CUDA cannot be faked on a CPU
build), so kernels that differ between devices (FlexAttention for packed rows on CUDA) are not rehearsed.

The private APIs it relies on (``torch._subclasses``, ``torch.distributed._tools``, ``torch.testing._internal``'s fake
process group) are imported in ``_torch_tools``; on a torch where they differ ``RehearsalUnavailable`` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from neva.checkpoint.architecture import neva_config_from_mm
from neva.checkpoint.source import ModelSource
from neva.config import TrainConfig
from neva.data.micro_batch import MicroBatch, pad_micro_batches, step_shape
from neva.models.config import NevaConfig
from neva.models.decoder_traits import traits
from neva.parallel.context_parallel import split_batch
from neva.parallel.expert_parallel import use_uniform_dispatch
from neva.parallel.layout import Layout
from neva.parallel.mesh import MESH_DIMS, build_mesh
from neva.parallel.precision import Precision
from neva.parallel.step_decisions import StepDecisions
from neva.stages import stage_spec
from neva.training.assembly import build_engine, build_parts
from neva.training.dpo import frozen_reference
from neva.training.engine import Engine
from neva.training.optim import build_optimizer
from neva.training.rehearsal_inputs import synthetic_micro_batches

# The tracker's categories, grouped as the planner reports memory (``neva.planner.plan.StageMemory``).
CATEGORIES = {
    "params": ("Parameter", "Sharded Param"),
    "grads": ("Gradient", "Sharded Grad"),
    "optimizer": ("Optstate", "OptState"),
    "activations": ("Activation",),
    "temporaries": ("Temp",),
    "working": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
    "other": ("Buffer", "Other", "Inputs"),  # RoPE tables; the step's input batches; one-process O2's masters
}

# What FSDP2's CPU offload (``model.fsdp_offload``) keeps in host memory: every sharded tensor and AdamW's states. On
# this CPU path they are counted like the rest; a GPU holds them on the host, so the device's peak leaves them out.
OFFLOADED = ("Sharded Param", "Sharded Grad", "Optstate", "OptState")

# Micro-batches that show every memory state of a step without pipelining: the first (no gradient yet), one in the
# middle (gradients accumulating) and the last (gradients reduced). See ``rehearse(micro_batches=...)``.
ENOUGH_MICRO_BATCHES = 3


class RehearsalUnavailable(RuntimeError):
    """The rehearsal cannot run here: this torch lacks (or changed) a private API it needs."""


def _torch_tools() -> dict[str, Any]:
    """The private torch pieces, imported together so that a torch without them fails in one place."""
    try:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining._utils import InferenceMode
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
        from torch.distributed.tensor.debug import (
            _clear_fast_path_sharding_prop_cache,
            _clear_python_sharding_prop_cache,
        )
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise RehearsalUnavailable(f"torch {torch.__version__} lacks an API the rehearsal needs: {e}") from e
    # Private members used besides the public ones: the peak so far, the per-parameter gradient hooks, the pipeline
    # stages' set-up (``_decide_pipeline_locally`` checks the instance attributes it sets where it sets them).
    require(MemTracker, "get_tracker_snapshot")
    require(MemTracker(), "_peak_mem", "_param_to_grad_hook_handles", "memory_tracking")
    require(FSDPMemTracker, "track_inputs")
    require(PipelineStage, "_prepare_forward_infra", "_prepare_backward_infra")
    require(PipelineScheduleSingle, "_initialize_stage")
    require(InferenceMode, "STATIC")
    return {
        "FakeTensorMode": FakeTensorMode,
        "FSDPMemTracker": FSDPMemTracker,
        "MemTracker": MemTracker,
        "FSDPModule": FSDPModule,
        "FakeStore": FakeStore,
        "InferenceMode": InferenceMode,
        "PipelineScheduleMulti": PipelineScheduleMulti,
        # DTensor caches sharding decisions by mesh shape; another rank role's mesh of the same shape has other
        # process groups, so the cache is emptied after every rank role.
        "clear_sharding_caches": lambda: (_clear_python_sharding_prop_cache(), _clear_fast_path_sharding_prop_cache()),
        "tracing": tracing,
        "TracingContext": TracingContext,
    }


def require(owner: Any, *members: str) -> None:
    """Raise ``RehearsalUnavailable`` naming the first of ``members`` that ``owner`` (a class or an instance of one
    of torch's private tools) lacks."""
    for member in members:
        if not hasattr(owner, member):
            name = owner.__name__ if isinstance(owner, type) else type(owner).__name__
            raise RehearsalUnavailable(f"torch {torch.__version__}: {name} has no {member}, which the rehearsal uses")


@dataclass(frozen=True)
class RankMemory:
    """The measured peak of one rank role: bytes per category at the moment of the peak, and where it fell."""

    stage: int
    rank: int
    peak: int
    categories: dict[str, int]
    where: str
    seconds: float
    host: int = 0  # bytes FSDP2's CPU offload keeps in host memory (not in ``peak``: the device's)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rank_roles(layout: Layout, stages: list[int] | None = None) -> list[tuple[int, int]]:
    """``(pipeline stage, global rank)`` of each distinct rank role: the (dp 0, cp 0, tp 0) rank of every stage (of
    ``stages``, default all).

    Context-parallel ranks hold the same number of columns (two chunks of ``S / 2cp``) and the tower inputs' shares
    differ by one at most, the remainder rotating over the ranks from micro-batch to micro-batch
    (``ContextShard.share_sizes``); what differs is the learned positions the head runs on. Rank 0 holds the row's
    last chunk, so with a sample's learned tokens at its end (the rehearsal's samples, and a conversation's answers)
    it holds the most of them whenever they are at most half the row: cp rank 0 stands for the others. When more is
    learned (pretraining's captions), the other ranks' front chunks are learned too while rank 0's front chunk holds
    the image positions: a rank can then hold up to ``min(S / 2cp, image positions)`` learned positions more than
    rank 0, whose logits (``· vocab · 6`` bytes without TP) the rehearsal does not show."""
    return [(s, s * layout.dp * layout.cp * layout.tp) for s in (range(layout.pp) if stages is None else stages)]


def edge_stages(layout: Layout) -> list[int]:
    """The first and the last pipeline stage: between them every part a stage can hold (vision, embeddings and the
    root inputs; the LM head and the loss; sends and receives). For memory a middle stage can still peak higher (one
    more decoder layer than the first when the layers do not divide evenly, fewer micro-batches in flight): the
    command line rehearses every stage."""
    return sorted({0, layout.pp - 1})


class _PeakLocator:
    """Keeps each micro-batch's module statistics (the trackers accept one root forward per iteration: a chunk's
    statistics are archived and dropped before every further micro-batch's forward through it) and names the module,
    phase and micro-batch of the peak afterwards."""

    def __init__(self, tracker: Any, roots: list[nn.Module], pipelined: bool = False) -> None:
        # ``roots``: the rank's pipeline chunks (one without pipelining); the first one's forwards count micro-batches.
        self.tracker, self.roots, self.root = tracker, roots, roots[0]
        self._started = False
        self._after_reference = False
        # Under 1F1B a micro-batch's statistics also hold the backward of an earlier one (up to pp - stage are in
        # flight): the place says which forward the backward followed.
        self.pipelined = pipelined
        self.archive: list[tuple[int, dict]] = []
        self.micro_batch = 0
        self.peak_before_optimizer = 0
        self.at_optimizer: dict = {}
        self._handle = None

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        # A chunk's forward outside backward (not an activation-checkpointing recomputation): a new micro-batch through
        # it. The trackers take one root forward per module between resets, so a chunk seen before has its modules'
        # statistics archived and dropped; only its own: interleaved chunks run one chunk's forwards of several
        # micro-batches while another's backward is pending, whose backward hooks still need their statistics.
        if module not in self.roots or torch._C._current_graph_task_id() != -1:
            return
        tracking = self.tracker.memory_tracking
        if module in tracking:
            self.archive.append((self.micro_batch, {m: tracking.pop(m) for m in module.modules() if m in tracking}))
        if module is self.root:
            # A forward without autograd is the preference stage's reference on this very model (LoRA's adapters
            # off), run just before its micro-batch's own forward: the two are one micro-batch.
            self.micro_batch += self._started and not self._after_reference
            self._started = True
            self._after_reference = not torch.is_grad_enabled()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        # A global hook registered before the tracker's own runs first (FSDPMemTracker's are per module).
        self._handle = nn.modules.module.register_module_forward_pre_hook(self._pre_forward)
        try:
            yield
        finally:
            self._handle.remove()

    def before_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.peak_before_optimizer = max((v for v in self.tracker._peak_mem.values()), default=0)
        # every gradient reduced, every AdamW state there: what FSDP2's CPU offload then holds on the host
        self.at_optimizer = next(iter(self.tracker.get_tracker_snapshot("current").values()), {})

    def device_peak(self, host: tuple[str, ...]) -> tuple[dict, str] | None:
        """Under FSDP2's CPU offload (``host``: the categories it keeps in host memory): the module snapshot whose
        bytes outside ``host`` are the most, and where it was taken; None when no module snapshot was taken."""
        stats = [*self.archive, (self.micro_batch, dict(self.tracker.memory_tracking))]
        best = None
        for mb, tracking in stats:
            for mod_stats in tracking.values():
                for state, snaps in mod_stats.snapshots.items():
                    name = str(getattr(state, "value", state))
                    for snap in snaps:
                        for per_device in snap.values():
                            held = {str(getattr(k, "value", k)): v for k, v in per_device.items()}
                            device = held.get("Total", 0) - sum(v for k, v in held.items() if k in host)
                            if best is None or device > best[0]:
                                phase = "backward" if "Backward" in name or "BW" in name else "forward"
                                module = mod_stats.mod_fqn.partition(".")[2] or "the root (embedding, head, vision)"
                                best = (device, per_device, f"micro-batch {mb + 1}, {phase} of {module}")
        return None if best is None else (best[1], best[2])

    def where(self, peak: int) -> str:
        """The deepest module whose own peak snapshot equals ``peak``: ``"micro-batch 3, backward of llm.layers.0"``."""
        stats = [*self.archive, (self.micro_batch, dict(self.tracker.memory_tracking))]
        best = None
        for mb, tracking in stats:
            for mod_stats in tracking.values():
                for state, snaps in mod_stats.snapshots.items():
                    name = str(getattr(state, "value", state))
                    if "Peak" not in name:
                        continue
                    for snap in snaps:
                        if any(d.get("Total", 0) == peak for d in snap.values()):
                            depth = mod_stats.mod_fqn.count(".")
                            phase = "backward" if "Backward" in name or "BW" in name else "forward"
                            if best is None or depth > best[0]:
                                module = mod_stats.mod_fqn.partition(".")[2] or "the root (embedding, head, vision)"
                                place = f"micro-batch {mb + 1}, {phase} of {module}"
                                if self.pipelined and phase == "backward":
                                    place = f"backward of {module}, after micro-batch {mb + 1}'s forward"
                                best = (depth, place)
        if best is not None:
            return best[1]
        if peak > self.peak_before_optimizer:
            return "optimizer step"
        return "outside the model's modules (the loss, its backward, or clipping)"


def rehearse(
    cfg: TrainConfig,
    text_tokens: int,
    learned_fraction: float = 0.5,
    model: NevaConfig | None = None,
    micro_batches: int | None = None,
    fake: bool = True,
    stages: list[int] | None = None,
    image_size: tuple[int, int] | None = None,
    num_frames: int | None = None,
) -> list[RankMemory]:
    """Run one optimizer step of every rank role of ``cfg``'s layout on fake tensors and measure its memory.

    Args:
        cfg: the composed run config (the world is ``trainer.devices × trainer.num_nodes``).
        text_tokens: text tokens per sample (the planner's ``plan.text_tokens``); each sample has one image (or video).
        learned_fraction: share of the text tokens that are learned (LM-head positions where the engine runs the
            head there, ``StepDecisions.learned_only_head``).
        model: the architecture, when it is not the one ``cfg.model.mm_cfg`` names (tests' tiny shapes).
        micro_batches: without pipelining, run only the first ``micro_batches - 1`` and the last micro-batch of the
            step. The step's micro-batches are identical, and from the second to the one before the last each sees
            the same tensors (gradients accumulating, no reduction), so 3 give the whole step's peak in less time.
        fake: False runs the same step on real tensors (the fake process group still moves no data): the tests'
            check that fake and real storage agree byte for byte, at tiny sizes.
        stages: the pipeline stages to rehearse (default: every stage; ``edge_stages``: the first and the last).
        image_size: an AnyRes image's ``(height, width)`` (``plan.image_size``; None: the largest pinpoint, as
            planned); its tiles and positions are the data side's (``neva.training.rehearsal_inputs``).
        num_frames: each sample one video of this many frames instead of one image (``plan.num_frames``).

    Raises:
        RehearsalUnavailable: this torch lacks a private API the rehearsal needs.
        RehearsalUnavailable: also for a preference stage under pipeline parallelism (not rehearsed yet).
        Exception: whatever the real path raises for this layout (the pre-flight's answer).
    """
    tools = _torch_tools()
    ncfg = model or neva_config_from_mm(cfg.model.mm_cfg, image_aspect_ratio=cfg.model.data.image_aspect_ratio)
    world = _world(cfg)
    layout = Layout.from_config(cfg.model, world, "cpu")
    if (
        not stage_spec(cfg.stage).rehearses_pipeline and layout.pp > 1
    ):  # its reference's own pipeline pass would need its schedule set up too
        raise RehearsalUnavailable(
            "plan.rehearse does not run a preference stage under pipeline parallelism yet "
            f"(model.pipeline_model_parallel_size={layout.pp}); the plan's estimate for it is the planner's alone"
        )
    batches = synthetic_micro_batches(cfg, ncfg, layout, text_tokens, learned_fraction, image_size, num_frames)
    # Each micro-batch's place in the step: context parallelism's split rotates the media remainders by it.
    batches = list(enumerate(batches))
    if micro_batches is not None and layout.pp == 1 and len(batches) > micro_batches:
        batches = batches[: micro_batches - 1] + batches[-1:]
    return [
        _rehearse_rank(cfg, ncfg, layout, rank, stage, batches, tools, fake)
        for stage, rank in rank_roles(layout, stages)
    ]


def _host_split(
    numbered: list[tuple[int, MicroBatch]], layout: Layout, parallel: Any
) -> list[tuple[MicroBatch, MicroBatch]]:
    """``(as the engine runs it, the loader's micro-batch)`` of each micro-batch. Under context parallelism the first
    is this rank's share, split here on the host before fake mode as training splits its host batches
    (``Engine._context_split``, which leaves a batch carrying its ``context`` as it is): the split reads index values
    (learned and media positions, segment ids, columns) that fake tensors lack. The share keeps the unsplit
    ``labels``: the engine counts the global batch's learned tokens on them, as it does before its own split. Only the
    share is cloned to fake tensors, so the step's inputs are what a GPU holds (the share, not the whole rows)."""
    if layout.cp == 1:
        return [(mb, mb) for _, mb in numbered]
    # The batches run unpacked (``_rehearse_rank``): one causal run per row; sequence parallelism pads to tp.
    multiple = StepDecisions.of(layout).sp_multiple
    cp_rank, group = parallel.dims.cp_rank, parallel.group("cp")
    return [
        (split_batch(mb, layout.cp, cp_rank, group, False, i, multiple).with_(labels=mb.labels), mb)
        for i, mb in numbered
    ]


def _host_grids(mb: MicroBatch, original: MicroBatch) -> MicroBatch:
    """``mb`` with the loader's own grids back: a native tower reads its grid as host integers
    (``neva.models.native_vision.grid_rows``), which a real tensor gives under fake mode and a fake clone cannot (it
    has no values); a grid is a few integers on the host in training too (``MediaInputs.to``)."""
    media = original.media
    if media is None:
        return mb
    grids = {m: v.grid for m, v in media.items() if v is not None and v.grid is not None}
    if not grids:
        return mb
    cloned = mb.media
    kept = {m: dataclasses.replace(getattr(cloned, m), grid=g) for m, g in grids.items()}
    return mb.with_(media=dataclasses.replace(cloned, **kept))


def _host_image_positions(mb: MicroBatch, original: MicroBatch) -> MicroBatch:
    """``mb`` with the loader's image positions back: a decoder whose images attend both ways (Gemma 3) reads them as
    host integers for its attention plan (``neva.models.attention``), which a fake clone cannot give; they stay on the
    host in training too (index tensors of a few entries; the splice takes them under fake mode as they are)."""
    media = original.media
    if media is None or media.image is None or media.image.positions is None:
        return mb
    image = dataclasses.replace(mb.media.image, positions=media.image.positions)
    return mb.with_(media=dataclasses.replace(mb.media, image=image))


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen_grad_hooks(tracker: Any, parts: list[nn.Module], fsdp_module: type) -> None:
    """MemTracker registers a gradient hook on every parameter of a module it meets, which fails on frozen ones (the
    vision tower): mark those as hooked already, with handles that remove nothing. Under FSDP2 (several pipeline
    chunks per rank, which ``FSDPMemTracker``'s one root cannot cover) a module's forward meets its unsharded
    parameters, other objects than the sharded ones: each unit is unsharded once (before tracking) to mark those."""
    for part in parts:
        units = [m for m in part.modules() if isinstance(m, fsdp_module)]
        for unit in units:
            unit.unshard()
        for p in part.parameters():
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        for unit in units:
            unit.reshard()


@torch.no_grad()
def _warm_optimizer(engine: Engine, optimizer: torch.optim.Optimizer) -> None:
    """Give AdamW the state every step after the first holds (it allocates it lazily in its first step): one step on
    zero gradients, before tracking starts, so the rehearsed step is a steady-state one."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _world(cfg: TrainConfig) -> int:
    """The planned world: ``trainer.devices`` per node, or the cluster's GPUs per node when it is not a number
    (``auto``), as ``neva.planner.deployment`` plans it (the layout printed beside the rehearsal)."""
    devices = cfg.trainer.devices
    return (devices if isinstance(devices, int) else cfg.cluster.gpus_per_node) * cfg.trainer.num_nodes


def _rehearse_rank(
    cfg: TrainConfig,
    ncfg: NevaConfig,
    layout: Layout,
    rank: int,
    stage: int,
    micro_batches: list[tuple[int, MicroBatch]],
    tools: dict[str, Any],
    fake: bool = True,
) -> RankMemory:
    start = time.perf_counter()
    device = torch.device("cpu")
    precision = Precision.from_config(cfg.trainer.precision, cfg.model.megatron_amp_O2)
    # Plans are applied on the meta device first and only this rank's shards are allocated (in fake mode).
    # Packed rows (collated as the run packs them) run as rows of the same shape under causal attention: the CPU's
    # per-segment attention finds its segments from the values (which fake tensors lack), and CUDA's FlexAttention
    # with a document mask keeps the activations of a causal attention of that shape (plus its small block mask).
    data = dataclasses.replace(cfg.model.data, packing=False)
    m = dataclasses.replace(cfg.model, meta_init=True, compile=False, data=data)
    mode = tools["FakeTensorMode"](allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    # DTensor's sharding propagation computes output metadata in the fake mode it detects; a TracingContext with a
    # second mode gives it its own, which the trackers skip (they count only ops of the mode active at entry).
    propagation = (
        tools["tracing"](tools["TracingContext"](tools["FakeTensorMode"]())) if fake else contextlib.nullcontext()
    )
    initialized = False
    if layout.is_distributed:
        dist.init_process_group("fake", rank=rank, world_size=layout.world, store=tools["FakeStore"]())
        initialized = True
    try:
        # The mesh and its sub-meshes are built outside fake mode (their coordinates are computed from tensors).
        dims = build_mesh(layout) if layout.is_distributed else None
        if dims is not None:
            for name in MESH_DIMS:
                dims.group(name)
        # Training's construction (every start-time rule of the run as configured, packing included; the stage's
        # objective), allocated in fake mode; a preference stage's reference as training runs it (a frozen copy,
        # allocated like the trained model; LoRA's adapters off; none when precomputed).
        source = ModelSource(cfg=ncfg, tokenizer=None)
        parts = build_parts(cfg, source, layout, device, precision, dims, settings=m, allocation=mode)
        parallel = parts.parallel
        run_cfg = dataclasses.replace(cfg, model=m)
        frozen = None
        if cfg.reference_kind() == "frozen":
            frozen = frozen_reference(run_cfg, source, layout, device, precision, dims, allocation=mode)
        split = _host_split(micro_batches, layout, parallel)
        if fake:  # MoE: routing has no values on fake tensors; the experts take uniform routing's group sizes
            for part in parallel.parts + (frozen.parts if frozen is not None else []):
                use_uniform_dispatch(part)
        with mode, propagation:
            engine = build_engine(parts, cfg, source, layout, device, precision, frozen=frozen)
            optimizer = build_optimizer(engine.named_trainable_parameters(), m.optim)
            _warm_optimizer(engine, optimizer)
            # The step's inputs as the device holds them (a GPU run copies each micro-batch over; on the CPU path
            # ``.to(device)`` would alias the loader's tensors, which the trackers then count only through views).
            # (pytree: the batch's Media is a registered node, its tensors cloned and tracked like the others)
            # (a ``ContextShard`` is a leaf: its index tensors stay on the host, as training keeps them)
            inputs = [pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, mb) for mb, _ in split]
            inputs = [_host_grids(mb, original) for mb, (_, original) in zip(inputs, split)]
            if traits(ncfg.llm).bidirectional_images:
                inputs = [_host_image_positions(mb, original) for mb, (_, original) in zip(inputs, split)]
            tensors = [v for v in pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor)]
            root = parallel.parts[0]
            if isinstance(root, tools["FSDPModule"]) and len(parallel.parts) == 1:
                tracker = tools["FSDPMemTracker"](root, optimizer)
                tracker.track_inputs(tuple(tensors))
                if frozen is not None:  # its shards, under "other" (this tracker follows its one root's parameters)
                    tracker.track_inputs(tuple(p for part in frozen.parts for p in part.parameters()))
            else:
                tracker = tools["MemTracker"]()
                _skip_frozen_grad_hooks(tracker, parallel.parts, tools["FSDPModule"])
                tracker.track_external(*parallel.parts, optimizer, *tensors)
                if frozen is not None:
                    _skip_frozen_grad_hooks(tracker, frozen.parts, tools["FSDPModule"])
                    tracker.track_external(*frozen.parts)
                if parallel.master is not None:
                    tracker.track_external(parallel.master.main_grad, *(p for _, p in parallel.master.named_master))
            # The frozen reference's forwards too: one per micro-batch, archived like the chunks' (not counted).
            roots = parallel.parts + (frozen.parts if frozen is not None else [])
            locator = _PeakLocator(tracker, roots, pipelined=parallel.runner is not None)
            optimizer.register_step_pre_hook(locator.before_optimizer)
            with locator.installed(), tracker:
                if parallel.runner is not None:  # inside the trackers: the stage's receive buffers are its memory
                    _decide_pipeline_locally(parallel.runner, inputs, engine.sp_multiple, ncfg, precision, tools)
                engine.optimizer_step(optimizer, inputs, cfg.trainer.gradient_clip_val)
            peak_snap = tracker.get_tracker_snapshot("peak")
    finally:
        if initialized:
            dist.destroy_process_group()
            tools["clear_sharding_caches"]()
    snap = next(iter(peak_snap.values()), {})
    host = 0
    where = None
    if layout.fsdp_offload:  # the sharded state waits in host memory: the device's peak is the rest's
        found = locator.device_peak(OFFLOADED)
        if found is not None:
            host = max(_held(snap, OFFLOADED), _held(found[0], OFFLOADED), _held(locator.at_optimizer, OFFLOADED))
            snap, where = {k: v for k, v in found[0].items() if str(getattr(k, "value", k)) not in OFFLOADED}, found[1]
            snap = {**snap, "Total": sum(v for k, v in snap.items() if str(getattr(k, "value", k)) != "Total")}
    categories = {k: sum(v for key, v in snap.items() if str(getattr(key, "value", key)) in names)
                  for k, names in CATEGORIES.items()}  # fmt: skip
    peak = snap.get("Total", 0)
    where = where or locator.where(peak)
    return RankMemory(stage, rank, peak, categories, where, time.perf_counter() - start, host)


def _held(snap: dict, names: tuple[str, ...]) -> int:
    return sum(v for k, v in snap.items() if str(getattr(k, "value", k)) in names)


# -- pipeline parallelism: the schedule's set-up decided on this rank ------------------------------------------------
# torch's ``PipelineStage`` learns its input and output shapes over the wire (a vote on static vs dynamic shapes read
# with ``.item()``, then metadata sent between stages, or a first forward); the fake process group moves no data. The
# shapes are known: the first stage takes the step's collated inputs, every stage passes on the decoder's hidden
# states ``[micro-batch rows, padded length, hidden]`` in the parameters' dtype (the residual stream's: bf16 under
# O2, fp32 under autocast). The rehearsal gives them to the stages as static shapes, decides the vote on this rank,
# and has the stages check every micro-batch's tensors against them (``_runtime_validate``), so a wrong shape fails.
# The schedule then runs as in training: its warm-up keeps ``pp - stage`` micro-batches in flight (1F1B), the
# receive buffers are allocated per micro-batch, and the sends and receives return at once.


def _decide_pipeline_locally(
    runner: Any, micro_batches: list[MicroBatch], multiple: int, ncfg: NevaConfig, precision: Precision, tools: dict
) -> None:
    """Build the schedule ``runner`` will run for ``micro_batches`` with static stage shapes, set up as its
    warm-up would set it up when every stage votes static."""
    # The replicas agree on the step's shape by an all-reduce read on the host; every replica of the rehearsal
    # collates the same micro-batches, so the local shape is the agreed one.
    runner.dp_group = None
    shape = step_shape(micro_batches, multiple)
    (first,), _, _ = runner._inputs(pad_micro_batches(micro_batches[:1], shape=shape))
    hidden = torch.empty((*shape, ncfg.llm.hidden_size), dtype=precision.param_dtype, device="meta", requires_grad=True)
    runner.static_io = lambda chunk, _: {"input_args": first if chunk == 0 else hidden, "output_args": hidden}
    n = len(micro_batches)
    schedule, stages = runner._schedule(shape, n, True)
    # One chunk per rank: a single-stage schedule; interleaved chunks: a multi-stage one, with its own flags.
    flags = ("_stage_forward_initialized", "_stage_backward_initialized")
    if isinstance(schedule, tools["PipelineScheduleMulti"]):
        flags = ("_stages_forward_initialized", "_stages_backward_initialized")
    require(schedule, *flags)
    for stage in stages:
        require(stage, "_runtime_validate", "_inference_mode")
        stage._runtime_validate = True
        stage._inference_mode = tools["InferenceMode"].STATIC
        stage._prepare_forward_infra(n, None, None, has_backward=True)
        stage._prepare_backward_infra(n, loss_fn=schedule._loss_fn)
    for flag in flags:
        setattr(schedule, flag, True)


def shallow(ncfg: NevaConfig, layout: Layout, layers_per_chunk: int = 1) -> NevaConfig:
    """``ncfg`` with every width kept and the depth cut to ``layers_per_chunk`` decoder layers per pipeline chunk (the
    first chunk keeps ``model.pipeline_first_stage_layers`` when set) and two vision layers: a quick pre-flight of a
    layout's shapes, plans and schedule (CI rehearses every preset so), not of its memory."""
    first = layout.first_stage_layers
    num_layers = layers_per_chunk * layout.num_chunks
    if first is not None:
        num_layers = first + layers_per_chunk * (layout.num_chunks - 1)
    vision = ncfg.vision
    if vision is not None:
        # A merger reads its tower's last block (the family's ``select``), as do features after the post-LayerNorm
        # (``feature_norm``: Gemma 3's); window attention keeps one windowed and one full block.
        kept = {"vision_select_layer": -1 if vision.feature_norm else vision.spec.select}
        if vision.spec.window_attention:
            kept["fullatt_block_indexes"] = [1]
        vision = dataclasses.replace(vision, num_layers=2, **kept)
    # layer_types (Gemma 3's sliding / global layers; a hybrid decoder's linear / full attention layers): the first
    # layers' kinds
    kinds = {} if ncfg.llm.layer_types is None else {"layer_types": ncfg.llm.layer_types[:num_layers]}
    linear = ncfg.llm.linear_attention
    if linear is not None:
        kinds["linear_attention"] = dataclasses.replace(linear, layer_types=linear.layer_types[:num_layers])
    llm = dataclasses.replace(ncfg.llm, num_layers=num_layers, **kinds)
    return dataclasses.replace(ncfg, llm=llm, vision=vision)
