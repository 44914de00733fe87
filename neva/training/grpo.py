"""The online RL stage's objective (``stage=grpo``): GRPO and its variants over a rollout batch.

A rollout batch is a collated micro-batch whose rows are prompt + completion, the completion's tokens labelled (as a
finetuning reply is), plus per row ``advantages`` ``[B]`` and per token, aligned with the position that predicts it
(``old_logps[b, t]``: the log-prob of token ``t + 1``, where ``labels[b, t + 1]`` is learned), ``old_logps`` (the
policy that sampled, recorded before the first update; absent when ``num_iterations`` is 1: the ratio is then 1 and
the detached log-probs stand in, as in TRL) and ``ref_logps`` (the reference's, added by ``prepare``; only with
``beta`` > 0). The alignment with ``input_ids`` lets every per-token tensor go wherever its tokens go (pipeline and
sequence-parallel padding, context-parallel shards: ``neva.parallel.pipeline.PAD_FILL``). Shared-prompt rows
(``neva.data.grpo_rows``: a prompt once, then each of its completions) carry ``advantages`` per completion ``[N]``,
``completion_at`` (each learned prediction's completion, aligned as above) and ``row_tokens`` per completion.

One class plays both of the engine's protocols (``neva.training.objectives``), as the preference stage's does: as the
head objective it sums the completions' token losses (``neva.models.grpo_loss``), each token weighted by its loss
type's rule, and counts the step's divisor on the host (completions, learned tokens, or completions × max new tokens);
the engine divides, so the step's loss is the variant's whatever the layout. As an auxiliary objective it runs the
reference forward in ``prepare`` (no gradient) and reports KL, clip fraction and entropy.

The reference is the starting weights (``beta`` > 0): a frozen second model built from the run's own source, or, under
LoRA, the trained model with its adapters off (``neva.training.dpo.frozen_reference``, ``adapters_disabled``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from neva.checkpoint.source import ModelSource
from neva.config import GRPOConfig, TrainConfig
from neva.constants import IGNORE_INDEX
from neva.data.grpo_prompts import PromptDataModule, collate_groups
from neva.errors import ConfigError
from neva.models.grpo_loss import LOSS_TYPES, token_losses
from neva.models.lora import adapters_disabled
from neva.parallel.layout import Layout
from neva.parallel.parallelize import ParallelModel
from neva.parallel.pipeline import PipelineRunner, pad_micro_batches
from neva.parallel.precision import Precision
from neva.stages.grpo import check_grpo_config as check_grpo_config  # the stage's rules, re-exported
from neva.training.dpo import frozen_reference

# What a step reports, in the order of the values summed over tokens and data-parallel ranks (then / tokens).
METRICS = ("kl", "clip_fraction", "entropy", "policy_loss")


def learned_counts(labels: torch.Tensor) -> torch.Tensor:
    """Each row's learned (completion) tokens ``[B]``, on the host labels."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(1)


def completion_counts(batch: dict[str, Any]) -> torch.Tensor:
    """Each completion's learned tokens ``[N]``: the batch's ``row_tokens`` where given (counted on whole rows before
    a context-parallel split; shared-prompt rows, ``neva.data.grpo_rows``, hold a group's completions in one row),
    else each row's (a row is a completion)."""
    counts = batch.get("row_tokens")
    return learned_counts(batch["labels"]) if counts is None else counts


def shares_prompts(engine: Any) -> bool:
    """Whether the update's rows share each prompt with its group (``neva.data.grpo_rows``; else one row per
    completion): the one place this is decided. Not where the rows' columns are split or sent as a whole (tensor
    parallelism's full logits and sequence padding, pipeline stages, context shards), nor where LoRA's keyed dropout
    reads each row as one sample, nor for decoders whose attention cannot take a shared prefix (linear attention's
    state, Llama 4's chunks), nor for MoE decoders (their routers' load-balancing statistics, part of the loss, would
    count each prompt token once instead of once per completion)."""
    layout = engine.parallel.layout
    llm = engine.parts[0].cfg.llm
    return (
        layout.tp == 1 and layout.pp == 1 and layout.cp == 1 and engine.sp_multiple == 1 and not engine.join_rows
        and not engine.keyed_dropout and llm.linear_attention is None and llm.attention_chunk_size is None
        and not llm.is_moe
    )  # fmt: skip


def aligned_logps(
    logits: torch.Tensor, batch: dict[str, Any], device: torch.device, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The learned tokens' log-probs of one forward as ``(logp, rows, index, entropy)``: ``logp`` and ``entropy``
    (None where not asked, or where the logits are vocab-sharded DTensors) are per learned token, ``rows`` its row, and
    ``index`` picks the same tokens out of a ``[B, S]`` tensor aligned with the batch as run (``flat[index]`` after
    ``.flatten()``).

    Learned-position logits ``[N, V]`` (``batch["output_positions"]``): one entry per learned token. Full logits
    ``[B, S, V]`` (TP: vocab-sharded under ``loss_parallel``): every position, the unlearned ones masked by the
    caller through ``rows`` = -1."""
    if logits.dim() == 2:
        positions = batch["output_positions"].to(device, non_blocking=True)
        targets = batch["targets"].to(device, non_blocking=True)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        logp = logprobs.gather(1, targets[:, None]).squeeze(1)
        ent = -(logprobs.exp() * logprobs).sum(-1) if entropy else None
        width = batch["input_ids"].shape[1]
        return logp, positions[:, 0], positions[:, 0] * width + positions[:, 1], ent
    b, s = logits.shape[:2]
    if batch.get("next_labels") is not None:  # a context-parallel shard: each position's own target
        target = batch["next_labels"][:b].to(device, non_blocking=True)
        flat = logits.float().flatten(0, 1)
        width = s
    else:  # the last position predicts nothing (as the preference stage's head reads them)
        target = batch["labels"][:b, 1:s].to(device, non_blocking=True)
        flat = logits[:, :-1].float().flatten(0, 1)
        width = s - 1
    nll = F.cross_entropy(flat, target.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
    ent = None
    if entropy and not isinstance(flat, DTensor):
        logprobs = torch.log_softmax(flat, dim=-1)
        ent = -(logprobs.exp() * logprobs).sum(-1)
    rows = torch.arange(b, device=device).repeat_interleave(width)
    rows = torch.where(target.flatten() != IGNORE_INDEX, rows, -1)
    cols = torch.arange(width, device=device).repeat(b)
    return -nll, rows, rows.clamp(min=0) * s + cols, ent


def _pick(aligned: torch.Tensor, index: torch.Tensor, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The entries of a ``[B, S]`` per-token tensor (in the batch as run) at ``index`` (``aligned_logps``)."""
    flat = aligned.to(device, torch.float32)
    b, s = batch["input_ids"].shape
    if flat.shape != (b, s):  # padded rows / columns beyond the tensor (pipeline padding): never learned
        full = flat.new_zeros(b, s)
        full[: flat.shape[0], : flat.shape[1]] = flat[:b, :s]
        flat = full
    return flat.flatten()[index]


def scatter_aligned(
    values: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, batch: dict[str, Any]
) -> torch.Tensor:
    """Per-token values of a forward (``aligned_logps``) as a ``[B, S]`` tensor aligned with ``batch`` (as run), zero at
    unlearned positions; under context parallelism the whole rows' tensor, every cp rank's columns gathered in row
    order (each rank then holds what one process computes, and the split hands each its share again)."""
    b, s = batch["input_ids"].shape
    keep = rows >= 0
    # no boolean selection (a data-dependent shape: the rehearsal's fake tensors cannot run it, and it syncs the
    # host): the dropped entries add zero at index 0, the kept ones land on their own (distinct) indices
    values = torch.where(keep, values.detach(), 0.0)
    out = values.new_zeros(b * s).index_put((torch.where(keep, index, 0),), values, accumulate=True).view(b, s)
    shard = batch.get("context")
    return out if shard is None else shard.gather_sequence(out, 1)


class GroupPolicyObjective:
    """GRPO / DAPO / Dr. GRPO head objective and auxiliary objective (metrics) of the online RL stage.

    Args:
        cfg: ``model.grpo``.
        reference: a rollout batch → the reference's per-token log-probs ``[B, S]`` aligned with it; None: no KL term
            (``beta`` 0), or the batch carries ``ref_logps``.
    """

    headline = ("kl",)  # the reward is the rollout's, shown beside it by the stage's step

    def __init__(self, cfg: GRPOConfig, reference: Callable[[dict[str, Any]], torch.Tensor] | None = None) -> None:
        self.cfg = cfg
        self.per_completion_mean, self.unit = LOSS_TYPES[cfg.loss_type]
        self.reference = reference
        self._sums: torch.Tensor | None = None
        self._held_out: torch.Tensor | None = None
        self.pp_group: Any = None
        self.cp_size = 1

    @classmethod
    def of(cls, cfg: TrainConfig) -> GroupPolicyObjective | None:
        """The objective of a ``stage=grpo`` run (its reference attached later: ``attach_reference``), else None. The
        stage's refused settings are start-time rules (its spec's ``check``, ``neva.stages.grpo``)."""
        if cfg.stage != "grpo":
            return None
        return cls(cfg.model.grpo)

    # -- head objective ---------------------------------------------------------------------------------------
    def count(self, batch: dict[str, Any]) -> torch.Tensor:
        counts = completion_counts(batch)
        if self.unit == "tokens":
            return counts.sum()
        rows = int((counts > 0).sum())  # a completion dropped by dynamic sampling learns nothing and is not counted
        return torch.tensor(rows if self.unit == "completions" else rows * self.cfg.max_new_tokens)

    # The loss is right on a context-parallel shard of a batch: each rank sums its own tokens' terms, with weights
    # counted on the whole rows (``prepare``), and the engine sums the gradients over cp.
    context_parallel = True

    def loss(self, logits: torch.Tensor, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
        logp, rows, index, ent = aligned_logps(logits, batch, device, entropy=True)
        learned = rows >= 0
        if "completion_at" in batch:  # shared-prompt rows: each learned token's completion, not its row
            rows = torch.where(learned, batch["completion_at"].to(device).flatten()[index], -1)
        safe_rows = rows.clamp(min=0)
        advantage = batch["advantages"].to(device, torch.float32)[safe_rows]
        old = _pick(batch["old_token_logps"], index, batch, device) if "old_token_logps" in batch else logp.detach()
        ref = _pick(batch["ref_token_logps"], index, batch, device) if "ref_token_logps" in batch else None
        losses, kl, bound = token_losses(
            logp, old, advantage, self.cfg.epsilon, self.cfg.clip_high, self.cfg.beta, ref,
            self.cfg.kl_ratio_correction, self.cfg.clip_ratio_dual,
        )  # fmt: skip
        weight = learned.float()
        if self.per_completion_mean:
            weight = weight / batch["row_tokens"].to(device, torch.float32).clamp(min=1)[safe_rows]
        total = (losses * weight).sum()
        self._record(learned, kl, bound, ent, losses, held_out=not torch.is_grad_enabled())
        return total

    def _record(self, learned, kl, bound, ent, losses, held_out: bool) -> None:
        m = learned.float()
        entropy = (ent * m).sum() if ent is not None else m.new_zeros(())
        entropy_tokens = m.sum() if ent is not None else m.new_zeros(())
        values = torch.stack([(kl.detach() * m).sum(), (bound.float() * m).sum(), entropy.detach(),
                              (losses.detach() * m).sum(), m.sum(), entropy_tokens])  # fmt: skip
        if held_out:
            self._held_out = values if self._held_out is None else self._held_out + values
        else:
            self._sums = values if self._sums is None else self._sums + values

    # -- auxiliary objective ----------------------------------------------------------------------------------
    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        if "row_tokens" not in batch:  # counted on the whole rows: context parallelism splits them later
            batch = {**batch, "row_tokens": learned_counts(batch["labels"])}
        if self.cfg.beta > 0 and "ref_token_logps" not in batch:
            if self.reference is None:
                raise ConfigError("model.grpo.beta > 0 but no reference is attached and the batch carries none")
            batch = {**batch, "ref_token_logps": self.reference(batch)}
        return batch

    def take(self, divisor: int) -> torch.Tensor:
        return torch.zeros(())  # the objective is the head's loss; nothing is added to it

    def step_values(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = self._sums if self._sums is not None else torch.zeros(len(METRICS) + 2, device=total.device)
        self._sums = None
        if self.pp_group is not None:
            values = values.to(total.device)
            dist.all_reduce(values, group=self.pp_group)
        return total, values.to(total.device)

    def held_out_values(self, device: torch.device) -> torch.Tensor | None:
        values = self._held_out
        self._held_out = None
        if values is None and self.pp_group is None:
            return None
        values = (values if values is not None else torch.zeros(len(METRICS) + 2)).to(device)
        if self.pp_group is not None:
            dist.all_reduce(values, group=self.pp_group)
        return values

    def metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = values[4].clamp(min=1)
        return {"kl": values[0] / tokens, "clip_fraction": values[1] / tokens, "entropy": values[2] / values[5],
                "policy_loss": values[3] / tokens}  # fmt: skip

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
        """The reference forward of the run when ``beta`` > 0: the engine's own model with its adapters off under
        LoRA, else a frozen model of the starting weights parallelized as the run is (``frozen``: built by the
        caller); none with ``beta`` 0 (no reference model is built)."""
        if layout.pp > 1:
            self.pp_group = engine.parallel.group("pp")
        if cfg.model.grpo.beta == 0:
            return
        if cfg.model.peft.peft_scheme == "lora":
            off = lambda: adapters_disabled(engine.model)  # noqa: E731
            runner, model = engine.parallel.runner, None
        else:
            off = contextlib.nullcontext
            ref = (
                frozen if frozen is not None else frozen_reference(cfg, source, layout, engine.device, precision, dims)
            )
            runner, model = ref.runner, ref.parts[0]
        self.reference = token_forward(engine, model, off) if layout.pp == 1 else pipeline_tokens(engine, runner, off)


def token_forward(
    engine: Any, model: torch.nn.Module | None, context: Callable[[], Any] = contextlib.nullcontext
) -> Callable[[dict[str, Any]], torch.Tensor]:
    """A rollout batch → per-token log-probs ``[B, S]`` aligned with it, of ``model`` (None: the engine's own; the
    reference, or the policy before the first update: ``old_logps``) run by the engine's rules under ``context``
    (LoRA: adapters off), without autograd."""

    def forward(batch: dict[str, Any]) -> torch.Tensor:
        b, s = batch["input_ids"].shape
        if engine.sp_multiple > 1:  # sequence parallelism splits the rows' positions evenly, as training pads them
            batch = pad_micro_batches([batch], engine.sp_multiple)[0]
        with torch.no_grad(), context():  # under the caller's loss_parallel (TP), which does not nest
            logits, ran = engine.head_logits(batch, model)
            logp, rows, index, _ = aligned_logps(logits, ran, engine.device)
            full = scatter_aligned(logp, index, rows, ran)
        return full[:b, :s]

    return forward


def pipeline_tokens(
    engine: Any, runner: PipelineRunner, context: Callable[[], Any] = contextlib.nullcontext
) -> Callable[[dict[str, Any]], torch.Tensor]:
    """``token_forward`` as a forward-only pipeline pass of ``runner``'s chunks; only the last stage, where the
    losses are formed, gets the values (the others zeros, read by nothing)."""

    def forward(batch: dict[str, Any]) -> torch.Tensor:
        found: list[torch.Tensor] = []

        def head(logits: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
            logp, rows, index, _ = aligned_logps(logits, mb, engine.device)
            found.append(scatter_aligned(logp, index, rows, mb))
            return torch.zeros((), device=engine.device)

        with torch.no_grad(), context():  # under the caller's loss_parallel (TP), which does not nest
            runner.evaluate([batch], engine.sp_multiple, head=head, split=engine._runner_split)
        b, s = batch["input_ids"].shape
        return found[-1][:b, :s] if found else torch.zeros(b, s, device=engine.device)

    return forward


def record_old_logps(engine: Any, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The micro-batches with the current policy's per-token log-probs as ``old_token_logps``: what the ``num_iterations``
    updates of one rollout batch take their ratio against (recorded once, before the first)."""
    forward = (
        token_forward(engine, None)
        if engine.parallel.runner is None
        else pipeline_tokens(engine, engine.parallel.runner)
    )
    with engine._loss_context():
        return [{**mb, "old_token_logps": forward(mb)} for mb in micro_batches]


def group_policy_objective(cfg: TrainConfig) -> GroupPolicyObjective:
    """The stage's objective (``neva.stages.grpo``): the rollouts' clipped policy objective replaces token CE."""
    return GroupPolicyObjective.of(cfg)


def prompt_data_module(cfg: TrainConfig) -> Any:
    """The stage's data module (``neva.stages.grpo``): prompts with checkable answers; the update's rows are the
    rollouts' (``neva.training.grpo_step``)."""
    return PromptDataModule


def rehearsal_groups(cfg: TrainConfig, sample: dict[str, Any], seq_length: int, layout: Layout) -> list[dict[str, Any]]:
    """The rehearsal's micro-batches (``neva.stages.grpo``): ``micro_batch_size`` prompts of the plan's sample, each
    its group of ``num_generations`` rows, collated as the stage's step collates them (a prompt's images encoded
    once), with zero advantages (the rollout itself is not rehearsed)."""
    group, mbs = cfg.model.grpo.num_generations, layout.micro_batch_size
    out = []
    for m in range(layout.grad_accum):
        rows = [{**sample, "id": m * mbs + i} for i in range(mbs) for _ in range(group)]
        batch = collate_groups(rows, group, 0, cfg.model.data.pad_to_multiple_of, seq_length)
        out.append({**batch, "advantages": torch.zeros(len(rows))})
    return out
