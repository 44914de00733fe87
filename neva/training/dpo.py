"""The preference stage's objective (``stage=dpo``): DPO and its variants over concatenated pair batches.

One class plays both of the engine's protocols (``neva.training.objectives``): as the head objective it turns the
policy's logits at the replies' tokens into per-sequence log-probs (rows ``[0, P)`` chosen, ``[P, 2P)`` rejected:
``neva.data.preference``) and sums the pairs' losses (``neva.models.preference_loss``) plus the SFT term; the engine
divides by the global batch's pairs, so the step's loss is the mean over pairs whatever the layout. As an auxiliary
objective it runs the reference forward in ``prepare`` (no gradient; before the policy's forward) and reports the
rewards and log-probs as metrics.

The reference is the starting weights: a frozen second model built from the run's own source, or, under LoRA, the
trained model with its adapters off (no copy); or, with ``model.dpo.precompute_ref_log_probs``, the records' values
and the values of one pass of that reference before training (``neva.training.reference_logps``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from neva.checkpoint.source import ModelSource
from neva.config import DPOConfig, TrainConfig
from neva.constants import IGNORE_INDEX
from neva.data.micro_batch import MicroBatch
from neva.data.preference import PairCollator, PreferenceDataModule, carries_reference
from neva.errors import ConfigError
from neva.models.lora import adapters_disabled
from neva.models.preference_loss import PREFERENCE_LOSSES, pair_losses, sequence_logps
from neva.models.trainable import TrainablePolicy, build_meta_model
from neva.parallel.context_parallel import all_reduce_sum
from neva.parallel.layout import Layout
from neva.parallel.parallelize import ParallelModel, parallelize
from neva.parallel.pipeline import PipelineRunner
from neva.parallel.precision import Precision
from neva.stages.dpo import check_preference_config as check_preference_config  # the stage's rules, re-exported
from neva.training.reference_logps import attach_precomputed

# What a step reports, in the order of the values summed over pairs and data-parallel ranks (then / pairs).
METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
    "logps/chosen", "logps/rejected", "ref_logps/chosen", "ref_logps/rejected", "dpo_loss", "sft_loss",
)  # fmt: skip


def batch_logps(
    logits: torch.Tensor, batch: MicroBatch, device: torch.device, mean: bool, cp_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence log-probs ``[2P]`` as the loss takes them, summed log-probs ``[2P]``, learned tokens ``[2P]``) of a
    pair batch's rows, from its logits at ``output_positions`` ``[N, V]`` or at every position ``[B, S, V]`` (TP:
    vocab-sharded, under ``loss_parallel``).

    ``cp_group``: the batch is this rank's context-parallel shard of the rows (``neva.parallel.context_parallel``);
    the sums and counts of its tokens are summed over the group (differentiably), so every cp rank holds the whole
    sequences' values, as one process computes them."""
    n_rows = 2 * int(batch.stage.pairs)
    if logits.dim() == 3:
        if batch.next_labels is not None:  # a context-parallel shard: each position's own target
            target = batch.next_labels[:n_rows].to(device, non_blocking=True)
            flat = logits[:n_rows].float().flatten(0, 1)
        else:
            target = batch.labels[:n_rows, 1:].to(device, non_blocking=True)
            flat = logits[:n_rows, :-1].float().flatten(0, 1)
        nll = F.cross_entropy(flat, target.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
        nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
        learned = target != IGNORE_INDEX
        sums, counts = -(nll.view(target.shape) * learned).sum(1), learned.sum(1).to(nll.dtype)
    else:
        targets = batch.targets.to(device, non_blocking=True)
        # packed pairs: the sequence of each learned position; padded: its row
        sequences = batch.stage.output_sequences
        rows = (batch.output_positions[:, 0] if sequences is None else sequences).to(device, non_blocking=True)
        token = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
        sums, counts = sequence_logps(token, rows, n_rows)
    if cp_group is not None:
        sums, counts = all_reduce_sum(sums, cp_group), all_reduce_sum(counts, cp_group)
    return (sums / counts.clamp(min=1) if mean else sums), sums, counts


class PreferenceObjective:
    """DPO head objective and auxiliary objective (metrics) of the preference stage.

    Args:
        cfg: ``model.dpo``.
        reference: a pair batch → the reference's sequence log-probs ``[2P]``; None: the batch carries
            ``ref_logps`` (precomputed).
    """

    headline = ("rewards/accuracy", "rewards/margin")  # is the policy learning the preferences, at a glance

    def __init__(self, cfg: DPOConfig, reference: Callable[[MicroBatch], torch.Tensor] | None = None) -> None:
        self.cfg = cfg
        self.mean = PREFERENCE_LOSSES[cfg.loss_type][1]
        self.reference = reference
        self._sums: torch.Tensor | None = None
        self._held_out: torch.Tensor | None = None  # the same sums over the validation forwards
        # Pipeline parallelism: only the last stage forms the pairs' losses; the metrics are summed over the stages.
        self.pp_group: Any = None
        # Context parallelism: each cp rank holds a share of every row's tokens; the sequences' log-probs are summed
        # over the group, so every cp rank forms the same pair losses and returns 1 / cp of them (the engine sums
        # the step objective and the gradients over dp x cp).
        self.cp_group: Any = None
        self.cp_size = 1

    @classmethod
    def of(cls, cfg: TrainConfig) -> PreferenceObjective | None:
        """The objective of a ``stage=dpo`` run (its reference attached later: ``attach_reference``), else None. The
        stage's refused settings are start-time rules (its spec's ``check``, ``neva.stages.dpo``)."""
        if cfg.stage != "dpo":
            return None
        return cls(cfg.model.dpo)

    # -- head objective ---------------------------------------------------------------------------------------
    def count(self, batch: MicroBatch) -> torch.Tensor:
        return torch.tensor(int(batch.stage.pairs))

    # The loss is right on a context-parallel shard of a batch (``check_run`` refuses a head that is not).
    context_parallel = True

    def loss(self, logits: torch.Tensor, batch: MicroBatch, device: torch.device) -> torch.Tensor:
        policy, sums, counts = batch_logps(logits, batch, device, self.mean, self.cp_group)
        reference = batch.stage.ref_logps.to(device, torch.float32)
        n = policy.shape[0] // 2
        losses = pair_losses(self.cfg.loss_type, self.cfg.beta, self.cfg.label_smoothing, policy, reference)
        # The SFT term: the chosen reply's mean token NLL, per pair.
        sft = -sums[:n] / counts[:n].clamp(min=1)
        total = (losses.sum() + self.cfg.sft_weight * sft.sum()) / self.cp_size
        # Training's forward (with autograd) feeds the step's metrics; validation's, the held-out ones.
        self._record(policy.detach(), reference, losses.detach(), sft.detach(), held_out=not torch.is_grad_enabled())
        return total

    def _record(
        self, policy: torch.Tensor, reference: torch.Tensor, losses: torch.Tensor, sft: torch.Tensor, held_out: bool
    ) -> None:
        n = policy.shape[0] // 2
        chosen = self.cfg.beta * (policy[:n] - reference[:n])
        rejected = self.cfg.beta * (policy[n:] - reference[n:])
        per_pair = torch.stack([chosen, rejected, (chosen > rejected).float(), chosen - rejected, policy[:n],
                                policy[n:], reference[:n], reference[n:], losses, sft])  # fmt: skip
        values = torch.cat([per_pair.sum(1), per_pair.new_tensor([n])])
        if held_out:
            self._held_out = values if self._held_out is None else self._held_out + values
        else:
            self._sums = values if self._sums is None else self._sums + values

    # -- auxiliary objective ----------------------------------------------------------------------------------
    def prepare(self, batch: MicroBatch) -> MicroBatch:
        if batch.stage.ref_logps is not None:
            return batch
        if self.reference is not None:  # on every micro-batch, an all-skipped one too: a sharded reference's
            return batch.with_stage(ref_logps=self.reference(batch))  # all-gathers must match on every rank
        if not batch.stage.pairs:
            return batch.with_stage(ref_logps=torch.zeros(0))
        raise ConfigError("model.dpo.precompute_ref_log_probs=true but a batch carries no reference log-probs")

    def take(self, divisor: int) -> torch.Tensor:
        return torch.zeros(())  # the objective is the head's loss; nothing is added to it

    def step_values(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = self._sums if self._sums is not None else torch.zeros(len(METRICS) + 1, device=total.device)
        self._sums = None
        if self.pp_group is not None:
            values = values.to(total.device)
            dist.all_reduce(values, group=self.pp_group)
        return total, values.to(total.device)

    def held_out_values(self, device: torch.device) -> torch.Tensor:
        """The validation forwards' sums (zeros where this rank formed no pair loss: an earlier pipeline stage)."""
        values = self._held_out if self._held_out is not None else torch.zeros(len(METRICS) + 1)
        self._held_out = None
        values = values.to(device)
        if self.pp_group is not None:
            dist.all_reduce(values, group=self.pp_group)
        return values

    def metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        pairs = values[-1].clamp(min=1)
        return {name: values[i] / pairs for i, name in enumerate(METRICS)}

    # -- the reference ----------------------------------------------------------------------------------------
    def attach_reference(
        self,
        engine: Any,
        cfg: TrainConfig,
        source: ModelSource,
        layout: Layout,
        precision: Precision,
        dims: Any = None,
        data: Any = None,
        frozen: ParallelModel | None = None,
    ) -> None:
        """The reference forward of the run (``live_reference``): the engine's own model with its adapters off under
        LoRA; else a frozen model of the starting weights, parallelized as the run is (under pipeline parallelism its
        forward is a pipeline pass of its own, whose last stage holds the log-probs; ``frozen``: that model, built
        by the caller: the rehearsal builds it under its fake allocation). Under
        ``precompute_ref_log_probs`` none: it scores the pairs of ``data`` (the run's data module) that carry no
        values once, before training, into ``<exp_dir>/reference_logps.pt`` (``neva.training.reference_logps``),
        and is dropped."""
        if layout.pp > 1:
            self.pp_group = engine.parallel.group("pp")
        if layout.cp > 1:
            self.cp_group, self.cp_size = engine.parallel.group("cp"), layout.cp
        if not cfg.model.dpo.precompute_ref_log_probs:
            self.reference = live_reference(engine, cfg, source, layout, precision, dims, self.mean, frozen)
            return
        datasets = [*data.train_datasets, *data.val_datasets] if data is not None else []
        if any(not carries_reference(r) for d in datasets for r in d.base.records):
            attach_precomputed(
                datasets, data.collator, lambda: live_reference(engine, cfg, source, layout, precision, dims, self.mean),
                engine, cfg.exp_manager.exp_dir, source, self.mean, str(cfg.trainer.precision),
                cfg.model.micro_batch_size, self.pp_group,
            )  # fmt: skip


def live_reference(
    engine: Any,
    cfg: TrainConfig,
    source: ModelSource,
    layout: Layout,
    precision: Precision,
    dims: Any,
    mean: bool,
    frozen: ParallelModel | None = None,
) -> Callable[[MicroBatch], torch.Tensor]:
    """The reference forward: the engine's own model with its adapters off under LoRA, else a frozen model of the
    starting weights; a pipeline pass of their chunks under pipeline parallelism."""
    if cfg.model.peft.peft_scheme == "lora":
        off = lambda: adapters_disabled(engine.model)  # noqa: E731
        if layout.pp > 1:
            return pipeline_reference(engine, engine.parallel.runner, off, mean)
        return reference_forward(engine, None, off, mean)
    ref = frozen if frozen is not None else frozen_reference(cfg, source, layout, engine.device, precision, dims)
    if layout.pp > 1:
        return pipeline_reference(engine, ref.runner, contextlib.nullcontext, mean)
    return reference_forward(engine, ref.parts[0], contextlib.nullcontext, mean)


def reference_forward(
    engine: Any, model: torch.nn.Module | None, context: Callable[[], Any], mean: bool
) -> Callable[[MicroBatch], torch.Tensor]:
    """A pair batch → the sequence log-probs ``[2P]`` of ``model`` (None: the engine's own) run by the engine's rules
    under ``context`` (LoRA: adapters off), without autograd."""

    def reference(batch: MicroBatch) -> torch.Tensor:
        with torch.no_grad(), context():
            # a packed batch is prepared again once its rows are joined: this forward needs no reference of its own
            # (an empty one stands for it, so that ``prepare`` does not ask for one)
            logits, ran = engine.head_logits(batch.with_stage(ref_logps=torch.zeros(0)), model)
            return batch_logps(logits, ran, engine.device, mean, cp_group(engine))[0]

    return reference


def pipeline_reference(
    engine: Any, runner: PipelineRunner, context: Callable[[], Any], mean: bool
) -> Callable[[MicroBatch], torch.Tensor]:
    """A pair batch → the sequence log-probs ``[2P]`` of the chunks ``runner`` schedules (the frozen reference's, or
    the trained ones under ``context``: LoRA's adapters off), by a forward-only pipeline pass. Only the last stage,
    where the policy's pair losses are formed, gets them; the other stages return zeros (read by nothing)."""

    def reference(batch: MicroBatch) -> torch.Tensor:
        found: list[torch.Tensor] = []

        def head(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
            found.append(batch_logps(logits, mb, engine.device, mean, cp_group(engine))[0])
            return torch.zeros((), device=engine.device)

        with torch.no_grad(), context():
            runner.evaluate([batch], engine.sp_multiple, head=head)
        return found[-1] if found else torch.zeros(2 * int(batch.stage.pairs), device=engine.device)

    return reference


def cp_group(engine: Any) -> Any:
    """The engine's context-parallel group, None without context parallelism."""
    return engine.parallel.group("cp") if engine.cp > 1 else None


def frozen_reference(
    cfg: TrainConfig,
    source: ModelSource,
    layout: Layout,
    device: torch.device,
    precision: Precision,
    dims: Any,
    allocation: contextlib.AbstractContextManager | None = None,
) -> ParallelModel:
    """The starting weights as a model that trains nothing, sharded by FSDP2 where the run shards (DDP cannot wrap a
    model without gradients, so a DDP run's reference is sharded too), cut into the run's pipeline chunks
    (``allocation``: as ``parallelize`` takes it, the rehearsal's fake tensors)."""
    frozen = TrainablePolicy(vision=False, projector=False, llm=False, lora=None)
    meta = build_meta_model(source.cfg, frozen)
    ref_layout = dataclasses.replace(layout, data_parallel="fsdp")
    model = parallelize(meta, source, ref_layout, cfg.model, device, precision, dims, allocation)
    for part in model.parts:
        part.eval()
    return model


def preference_objective(cfg: TrainConfig) -> PreferenceObjective:
    """The stage's objective (``neva.stages.dpo``): the pairs' losses replace token cross-entropy."""
    return PreferenceObjective.of(cfg)


def preference_data_module(cfg: TrainConfig) -> Callable[..., Any]:
    """The stage's data module (``neva.stages.dpo``): preference pairs (``neva.data.preference``)."""
    return functools.partial(PreferenceDataModule, precomputed=cfg.model.dpo.precompute_ref_log_probs)


def rehearsal_pairs(cfg: TrainConfig, sample: dict[str, Any], seq_length: int, layout: Layout) -> list[MicroBatch]:
    """The rehearsal's micro-batches (``neva.stages.dpo``): pairs of the plan's sample, as the stage's data module
    collates them."""
    data = cfg.model.data
    collate = PairCollator(0, seq_length, data.pad_to_multiple_of)
    reference = {"ref_logps": torch.zeros(2)} if cfg.model.dpo.precompute_ref_log_probs else {}
    return [
        collate([{"chosen": {**sample, "id": i}, "rejected": {**sample, "id": i}, **reference}
                 for i in range(m * layout.micro_batch_size, (m + 1) * layout.micro_batch_size)])
        for m in range(layout.grad_accum)
    ]  # fmt: skip
