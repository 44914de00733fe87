"""Pipeline parallelism with ``torch.distributed.pipelining``: chunking the model, schedules, one shape per step.

The decoder's layers are cut into ``pp × virtual`` chunks; chunk ``c`` runs on pipeline rank ``c % pp`` (the
interleaved "loop" placement). Chunk 0 also owns the vision tower, the projector, the AnyRes newline and the token
embedding, the last chunk the final norm and the LM head (``neva.parallel.stage_owners``, the one table). Every chunk is a NevaModel with the other parts removed, so parameter names
stay those of the whole model (checkpoints are layout-independent).

Multimodal micro-batches differ in length and image count. Stages exchange activations whose shapes are agreed once
per schedule, so every micro-batch of a step is padded to the step's longest (right padding and learned-token-free
rows change no real token's result: ``neva.data.micro_batch.MicroBatch.padded``), and one schedule is kept per padded
shape.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from neva.data.micro_batch import MicroBatch, pad_micro_batches, step_shape
from neva.models.config import NevaConfig
from neva.models.loss import token_cross_entropy
from neva.models.media import Media
from neva.models.neva import NevaModel
from neva.parallel.stage_owners import prune_to_chunk
from neva.typed import ConfigError


def split_layers(num_layers: int, chunks: int, first_chunk_layers: int | None = None) -> list[list[int]]:
    """Decoder layer indices of each chunk: even split (remainder to the last chunks), or ``first_chunk_layers`` on
    chunk 0 (it also runs the vision tower) and the rest spread evenly.

    Raises:
        ConfigError: a chunk would get no layer.
    """
    if first_chunk_layers is None:
        sizes = split_sizes(num_layers, chunks)
    else:
        rest = num_layers - first_chunk_layers
        if chunks == 1 or rest < chunks - 1:
            raise ConfigError(
                f"model.pipeline_first_stage_layers={first_chunk_layers} leaves {rest} decoder layers for "
                f"{chunks - 1} other pipeline chunks"
            )
        sizes = [first_chunk_layers] + split_sizes(rest, chunks - 1)
    if min(sizes) < 1:
        raise ConfigError(
            f"{num_layers} decoder layers cannot fill {chunks} pipeline chunks (pipeline_model_parallel_size × "
            "virtual_pipeline_model_parallel_size); every chunk needs at least one layer"
        )
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` near-equal groups; the larger ones last (the first chunk also runs vision)."""
    return [n // parts + (1 if i >= parts - n % parts else 0) for i in range(parts)]


def local_chunks(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Chunk ids run by ``pp_rank`` (loop placement: rank r runs chunks r, r + pp, ...)."""
    return [pp_rank + v * pp for v in range(virtual)]


def check_splittable(cfg: NevaConfig, pp: int) -> None:
    """Refuse a model that cannot be split over ``pp`` stages (a start-time rule: ``run_rules.check_run``)."""
    if pp > 1 and cfg.llm.tie_word_embeddings:
        raise ConfigError("tied word embeddings cannot be split over pipeline stages (first and last stage share them)")


def check_deepstack_split(cfg: NevaConfig, layer_split: list[list[int]]) -> None:
    """DeepStack features (Qwen3-VL) are made on the first chunk, by the embedding, and not sent between stages:
    every layer they join must be there too.

    Raises:
        ConfigError: a DeepStack layer on a later chunk, naming the keys that move it.
    """
    k = cfg.deepstack_layers
    if k and layer_split[0][-1] < k - 1:
        raise ConfigError(
            f"DeepStack features join decoder layers 0..{k - 1} (projector.deepstack_mergers={k}), which must all "
            f"be on the first pipeline chunk, which holds {len(layer_split[0])}: set model.pipeline_first_stage_layers "
            f">= {k} (or fewer pipeline chunks)"
        )


def build_chunks(model: NevaModel, pp_rank: int, pp: int, virtual: int, first_layers: int | None) -> list[NevaModel]:
    """This rank's chunk models cut from ``model`` (the last one reuses ``model`` itself)."""
    check_splittable(model.cfg, pp)
    chunks = pp * virtual
    layer_split = split_layers(model.cfg.llm.num_layers, chunks, first_layers)
    check_deepstack_split(model.cfg, layer_split)
    ids = local_chunks(pp_rank, pp, virtual)
    out = []
    for k, c in enumerate(ids):
        source = model if k == len(ids) - 1 else copy.deepcopy(model)
        out.append(prune_to_chunk(source, layer_split, c))
    return out


def check_microbatches(schedule: str, pp: int, n_microbatches: int) -> None:
    """A 1F1B schedule needs at least one micro-batch per pipeline stage in flight (a start-time rule:
    ``run_rules.check_run``).

    Raises:
        ConfigError: fewer micro-batches per step than pipeline stages under ``1f1b`` / ``interleaved_1f1b``.
    """
    if pp > 1 and schedule != "gpipe" and n_microbatches < pp:
        raise ConfigError(
            f"{schedule} needs at least pipeline_model_parallel_size={pp} micro-batches per step, got "
            f"{n_microbatches} (global_batch_size / (micro_batch_size × data-parallel size)); raise "
            "model.global_batch_size or use model.pipeline_schedule=gpipe"
        )


def check_interleaved(schedule: str, pp: int, chunks_per_rank: int) -> None:
    """The interleaved schedule runs several chunks per pipeline rank.

    Raises:
        ConfigError: ``interleaved_1f1b`` with one chunk per rank (no virtual pipeline size).
    """
    if pp > 1 and schedule == "interleaved_1f1b" and chunks_per_rank < 2:
        raise ConfigError("interleaved_1f1b needs model.virtual_pipeline_model_parallel_size >= 2")


class PipelineRunner:
    """Runs one step's micro-batches through this rank's stages with the configured schedule.

    Args:
        chunks: this rank's chunk models (parallelized already), in local chunk order.
        chunk_ids: global chunk id of each.
        num_chunks: pp × virtual.
        pp_group: process group of the pipeline ranks.
        device: where activations live.
        schedule: ``1f1b`` | ``interleaved_1f1b`` | ``gpipe``.
        n_microbatches: micro-batches per step on this rank.
        packed: pass ``segment_ids`` (packed rows) or drop them (right-padded rows use plain causal attention).
        autocast: context for the forward passes (bf16 autocast), or None.
        dp_group: process group of the data-parallel replicas (None = one), which agree on each step's shape.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        chunk_ids: list[int],
        num_chunks: int,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        schedule: str,
        n_microbatches: int,
        packed: bool,
        autocast: Callable[[], Any] | None = None,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        pp = dist.get_world_size(pp_group)
        check_microbatches(schedule, pp, n_microbatches)
        check_interleaved(schedule, pp, len(chunks))
        self.chunks, self.chunk_ids, self.num_chunks = chunks, chunk_ids, num_chunks
        self.pp_group, self.device, self.schedule_name = pp_group, device, schedule
        self.n_microbatches, self.packed = n_microbatches, packed
        self.autocast = autocast
        self.dp_group = dp_group
        self.holds_last = num_chunks - 1 in chunk_ids
        self.holds_first = 0 in chunk_ids
        self._schedules: dict[tuple[int, int], Any] = {}
        self._weight: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._grad_factor = 1.0
        self._shifted = False  # context parallelism: the targets are each position's own next-token labels
        self._loss_sums: list[torch.Tensor] = []
        # The step's head objective (None: token cross-entropy on the labels) and its micro-batches by their labels'
        # identity: the schedule hands the loss function only a micro-batch's target (its labels tensor).
        self._head: Callable[[torch.Tensor, MicroBatch], torch.Tensor] | None = None
        self._by_target: dict[int, MicroBatch] = {}
        # Static stage inputs and outputs (``PipelineStage``'s ``input_args`` / ``output_args``) per (chunk id, padded
        # step shape), instead of inferring them over the wire: the full-size rehearsal's fake tensors and fake process
        # group move no data (``neva.training.rehearsal``). None in training.
        self.static_io: Callable[[int, tuple[int, ...]], dict[str, Any]] | None = None

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The weight comes from the micro-batch's own labels: the schedule does not say which micro-batch this is.
        # A head objective reads its whole micro-batch (the preference stage: the pairs and the reference's
        # log-probs). A new schedule's set-up call passes a copy of the labels (no micro-batch of the step): token
        # cross-entropy there, as without a head; only its gradients' shapes are used.
        mb = self._by_target.get(id(labels)) if self._head is not None else None
        loss = token_cross_entropy(logits, labels, shifted=self._shifted)[0] if mb is None else self._head(logits, mb)
        weight = self._weight(labels) if self._weight is not None else 1.0
        self._loss_sums.append((loss.detach() * weight).float())
        return loss * (weight * self._grad_factor)

    def _schedule(self, shape: tuple[int, ...], n: int, train: bool):
        key = (train, n, *shape)
        if key not in self._schedules:
            static = self.static_io or (lambda cid, shape: {})
            stages = [
                PipelineStage(chunk, cid, self.num_chunks, self.device, group=self.pp_group, **static(cid, shape))
                for chunk, cid in zip(self.chunks, self.chunk_ids)
            ]
            name = self.schedule_name if train else "gpipe"  # evaluation: forward only, any micro-batch count
            if name == "interleaved_1f1b":
                sched = ScheduleInterleaved1F1B(stages, n, loss_fn=self._loss_fn, scale_grads=False)
            elif name == "gpipe" and len(stages) == 1:
                sched = ScheduleGPipe(stages[0], n, loss_fn=self._loss_fn, scale_grads=False)
            elif name == "gpipe":
                from torch.distributed.pipelining import ScheduleLoopedBFS

                sched = ScheduleLoopedBFS(stages, n, loss_fn=self._loss_fn, scale_grads=False)
            else:
                sched = Schedule1F1B(stages[0], n, loss_fn=self._loss_fn, scale_grads=False)
            if not train:
                sched._has_backward = False
            self._schedules[key] = (sched, stages)
        return self._schedules[key]

    def _inputs(self, micro_batches: list[MicroBatch]):
        """Stage inputs: the ids as the one positional input (the first stage's), the micro-batch's ``Media`` and
        per-token tensors as keywords (stages without the embedding, taking hidden states, ignore the media)."""
        args, kwargs, targets = [], [], []
        for mb in micro_batches:
            args.append((mb.input_ids.to(self.device),))
            media = mb.media or Media()  # a stage's inputs are the same structure for every micro-batch
            kw = {"media": media.to(self.device), "position_ids": mb.position_ids.to(self.device)}
            if self.packed:
                kw["segment_ids"] = mb.segment_ids.to(self.device)
            # Per-token keyword inputs besides positions and segments: LoRA dropout keys (every stage), an MoE
            # model's token mask (its routers count only those tokens). A micro-batch without one of them passes
            # none, as a batch without it does.
            for key in ("dropout_keys", "token_mask"):
                if getattr(mb, key) is not None:
                    kw[key] = getattr(mb, key).to(self.device)
            if mb.context is not None:  # context parallelism: this rank's share of the rows, every stage
                kw["context"] = mb.context.to(self.device)
            kwargs.append(kw)
            targets.append((mb.next_labels if mb.next_labels is not None else mb.labels).to(self.device))
        return args, kwargs, targets

    def forward_backward(
        self,
        micro_batches: list[MicroBatch],
        weight: Callable[[torch.Tensor], torch.Tensor],
        grad_factor: float,
        multiple: int = 1,
        head: Callable[[torch.Tensor, MicroBatch], torch.Tensor] | None = None,
        split: Callable[[MicroBatch], MicroBatch] | None = None,
    ):
        """Run the schedule (forward + backward of every micro-batch); returns the weighted sum of the micro-batches'
        losses (``weight(labels)`` each; backward of that times ``grad_factor``) on every pipeline rank. A loss is
        ``head(logits, padded micro-batch)`` on the last stage, token cross-entropy when ``head`` is None.
        ``split``: context parallelism's, applied to each padded micro-batch (``neva.parallel.context_parallel``)."""
        return self._run(micro_batches, weight, grad_factor, multiple, train=True, head=head, split=split)

    @torch.no_grad()
    def evaluate(
        self,
        micro_batches: list[MicroBatch],
        multiple: int = 1,
        head: Callable[[torch.Tensor, MicroBatch], torch.Tensor] | None = None,
        split: Callable | None = None,
    ) -> torch.Tensor:
        """Forward only; the summed loss (``head``'s, token cross-entropy by default) on every pipeline rank."""
        return self._run(micro_batches, None, 1.0, multiple, train=False, head=head, split=split)

    def _agreed_shape(self, micro_batches: list[MicroBatch], multiple: int) -> tuple[int, int]:
        """The step's padded shape, the largest over the data-parallel replicas.

        A new shape builds a new schedule, whose first step runs an extra forward to set its stages up; replicas
        padding to their own longest would then run different forwards, and FSDP2's gathers (or DDP's reductions) of
        one replica would meet another's next collective.
        """
        shape = step_shape(micro_batches, multiple)
        if self.dp_group is None:
            return shape
        agreed = torch.tensor(shape, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(agreed[0]), int(agreed[1])

    def _run(
        self, micro_batches, weight, grad_factor: float, multiple: int, train: bool, head=None, split=None
    ) -> torch.Tensor:
        micro_batches = pad_micro_batches(micro_batches, shape=self._agreed_shape(micro_batches, multiple))
        if split is not None:
            micro_batches = [split(mb) for mb in micro_batches]
        self._shifted = split is not None
        n = len(micro_batches)
        schedule, stages = self._schedule(micro_batches[0].shape, n, train)
        # What ``schedule.step`` does before ``_step_microbatches`` (which takes ready-made micro-batches: a step's
        # images cannot be split by rows the way ``step`` chunks its inputs).
        for stage in stages:
            stage.has_backward = train
            stage.clear_runtime_states()
        self._weight, self._grad_factor = weight, grad_factor
        self._loss_sums = []
        args, kwargs, targets = self._inputs(micro_batches)
        self._head = head
        self._by_target = {id(t): mb for t, mb in zip(targets, micro_batches)} if head is not None else {}
        ctx = self.autocast() if self.autocast is not None else contextlib.nullcontext()
        try:
            with ctx:
                schedule._step_microbatches(arg_mbs=args, kwarg_mbs=kwargs, target_mbs=targets, return_outputs=False)
        finally:
            self._head, self._by_target = None, {}
        # A new schedule's first step also evaluates the loss once while it sets the stages up; the micro-batch
        # losses are the last ``n`` calls.
        sums = self._loss_sums[-n:] if self.holds_last else []
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=self.device)
        total = total.to(self.device)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage computed the loss
        return total
