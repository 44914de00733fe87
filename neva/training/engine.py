"""One optimizer step's worth of forward/backward over this rank's parts, the same code for every layout.

By default (``model.loss_normalization=global_tokens``) the loss of a step is the sum of token cross-entropies over
all micro-batches of all data-parallel ranks divided by the number of learned tokens in that whole global batch.
Gradient accumulation and every parallel layout then compute the same update as one process running the whole global
batch (a per-micro-batch mean would weight tokens differently whenever micro-batches hold different numbers of learned
tokens). ``micro_batch_mean`` is that per-micro-batch mean, as LLaVA (HF Trainer) and NeMo compute it, for
reproducing their curves (``neva.models.loss.micro_batch_weight``).

Under context parallelism (``neva.parallel.context_parallel``) each cp rank runs its share of every micro-batch's
tokens: the learned tokens are counted before the split (the normaliser stays the global batch's), each rank's loss
sums its own learned tokens, and gradients and the step objective are summed over dp × cp.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from neva.checkpoint.names import named_parameters
from neva.data.collate import join_rows
from neva.models.lora import LoRALinear, token_dropout_keys
from neva.models.loss import learned_positions, micro_batch_weight
from neva.parallel.context_parallel import split_batch
from neva.parallel.grad_norm import clip_grads_, global_grad_norm
from neva.parallel.parallelize import ParallelModel
from neva.parallel.pipeline import pad_micro_batches
from neva.parallel.precision import Precision
from neva.parallel.step_decisions import StepDecisions
from neva.training.objectives import AuxObjective, HeadObjective, TokenCrossEntropy, aux_objectives

# The model's per-token inputs besides the ids (dropout_keys: the engine's LoRA dropout keys; token_mask: MoE's).
TOKEN_INPUTS = ("position_ids", "segment_ids", "dropout_keys", "token_mask")


def model_inputs(batch: dict[str, Any], device: torch.device, packed: bool = True) -> dict[str, Any]:
    """The model's keyword inputs from a collated micro-batch, on ``device``: the ids, its ``Media`` and the per-token
    inputs.

    Unpacked, right-padded batches drop ``segment_ids``: padding sits after every real token, so plain causal
    attention gives the same result for the real tokens and lets SDPA use its fastest kernel. Shared-prompt rows
    (``shared_prefix``: the online RL stage's groups, ``neva.data.grpo_rows``) keep them: they say where each
    completion starts.
    """
    shared = bool(batch.get("shared_prefix"))
    out = {
        "input_ids": batch["input_ids"].to(device, non_blocking=True),
        "media": batch["media"].to(device, non_blocking=True) if batch.get("media") is not None else None,
    }
    for key in TOKEN_INPUTS:
        value = batch.get(key)
        if key == "segment_ids" and not packed and not shared:
            continue
        out[key] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
    if shared:
        out["shared_prefix"] = True
    if batch.get("context") is not None:  # context parallelism: this rank's share of the rows
        out["context"] = batch["context"].to(device, non_blocking=True)
    return out


class Engine:
    """Runs forward/backward for a list of micro-batches and owns what the optimizer steps.

    Args:
        parallel: this rank's parallelized model (``neva.parallel.parallelize``).
        precision: fp32 / bf16 autocast / bf16 O2.
        device: where inputs go.
        packed: batches are packed rows (keep ``segment_ids``).
        loss_normalization: ``model.loss_normalization`` (``neva.models.loss.LOSS_NORMALIZATIONS``).
        head: what the LM head's logits become (``neva.training.objectives``; default token cross-entropy).
        objectives: auxiliary objectives beside the model's own (MoE's routers).
    """

    def __init__(
        self,
        parallel: ParallelModel,
        precision: Precision,
        device: torch.device,
        packed: bool,
        loss_normalization: str = "global_tokens",
        head: HeadObjective | None = None,
        objectives: tuple[AuxObjective, ...] = (),
    ) -> None:
        self.parallel = parallel
        self.head = head or TokenCrossEntropy()
        self.loss_normalization = loss_normalization
        self.parts = parallel.parts
        self.master = parallel.master
        self.precision = precision
        self.device = device
        self.packed = packed
        layout = parallel.layout
        self.dp_group = parallel.group("dp")
        self.dp_size = layout.dp
        # Gradients and the step objective are summed over dp × cp (each cp rank holds a share of every micro-batch).
        self.grad_group = parallel.grad_group
        self.grad_size = layout.dp_cp
        self.cp = layout.cp
        self._split_count = 0
        # train()/eval() and the hooks of the data-parallel wrapper go through ``model``.
        self.model: nn.Module = parallel.forward_model if len(self.parts) == 1 else nn.ModuleList(self.parts)
        # The layout's step decisions, the planner's too (``neva.parallel.step_decisions``): the LM head at learned
        # positions only, the sequence-parallel padding multiple, packed rows joined into one.
        decisions = StepDecisions.of(layout)
        self.learned_only_head = decisions.learned_only_head
        self.sp_multiple = decisions.sp_multiple
        self.join_rows = decisions.join_rows(packed, device)
        # LoRA dropout masks keyed by sample and position (the same in every layout) need per-token keys.
        self.keyed_dropout = any(isinstance(m, LoRALinear) and m.p > 0 for part in self.parts for m in part.modules())
        # Auxiliary objectives (MoE: the routers' load-balancing losses) join each micro-batch's loss
        # (neva/training/objectives.py); none for a dense model.
        self.objectives = aux_objectives(self.parts, layout, parallel.group("pp"), parallel.group("cp")) + tuple(
            objectives
        )
        self._aux_stats: dict[str, torch.Tensor] = {}

    @property
    def aux_metrics(self) -> dict[str, float]:
        """The last step's metrics of the auxiliary objectives (MoE: the routers' loss term, per-layer min / max
        expert load), read on the host."""
        return {k: float(v) for k, v in self._aux_stats.items()}

    @property
    def headline_metrics(self) -> list[str]:
        """The auxiliary objectives' metrics the progress bar shows (``AuxObjective.headline``)."""
        return [k for objective in self.objectives for k in objective.headline]

    def _prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        for objective in self.objectives:
            batch = objective.prepare(batch)
        return batch

    # -- what the optimizer sees -------------------------------------------------------------------------------
    def named_trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        if self.master is not None:
            return self.master.named_master
        return [(n, p) for n, p in named_parameters(self.parts) if p.requires_grad]

    def checkpoint_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter of this rank as checkpoints store it, under its plain name: the fp32 master copy of a
        trained parameter under one-process O2 (what the optimizer steps), the parameter itself otherwise."""
        masters = dict(self.master.named_master) if self.master is not None else {}
        return [(n, masters.get(n, p)) for n, p in named_parameters(self.parts)]

    def after_optimizer_step(self) -> None:
        if self.master is not None:
            self.master.publish()

    # -- compute -----------------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision context (bf16 autocast, or nothing): what generation on the training model runs
        under too."""
        return self._autocast()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.autocast_dtype)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.parallel.vocab_parallel else contextlib.nullcontext()

    def loss_sum(self, batch: dict[str, Any]) -> torch.Tensor:
        """Summed loss of one micro-batch (forward only): the head objective's, token cross-entropy by default."""
        if self.sp_multiple > 1:
            batch = pad_micro_batches([batch], self.sp_multiple)[0]
        logits, batch = self.head_logits(self._prepare(batch))
        loss = self.head.loss(logits, batch, self.device)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def head_logits(self, batch: dict[str, Any], model: nn.Module | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(logits, the batch as run)`` of ``model`` (default: the trained one; the preference objective passes its
        reference) on a prepared micro-batch: ``[N, V]`` at the batch's output positions, or ``[B, S, V]`` at every
        position where the LM head runs on all (TP layouts: vocab-sharded under ``loss_parallel``)."""
        model = self.model if model is None else model
        if not self.learned_only_head:
            batch = self._context_split(batch)
            with self._autocast():
                return model(**model_inputs(batch, self.device, self.packed)), batch
        if "output_positions" not in batch:  # a hand-built batch: found from its host labels (still no device sync)
            positions, targets = learned_positions(batch["labels"])
            batch = {**batch, "output_positions": positions, "targets": targets}
        if self.join_rows and batch.get("segment_ids") is not None:
            batch = self._prepare(join_rows(batch))
        batch = self._context_split(batch)
        inputs = model_inputs(batch, self.device, self.packed)
        positions = batch["output_positions"].to(self.device, non_blocking=True)
        with self._autocast():
            logits = model(**inputs, output_positions=positions)
        return logits, batch

    def pipeline_head(self) -> Callable[[torch.Tensor, dict[str, Any]], torch.Tensor] | None:
        """The head objective as the pipeline's last stage calls it on a padded micro-batch's logits; None for token
        cross-entropy, which the runner computes from the labels alone."""
        if isinstance(self.head, TokenCrossEntropy):
            return None
        return functools.partial(self.head.loss, device=self.device)

    @property
    def _runner_split(self):
        return self._context_split if self.cp > 1 else None

    def _context_split(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of the micro-batch's rows under context parallelism (unchanged otherwise, and for a
        micro-batch that carries its ``context`` already: the rehearsal splits its host batches before fake mode,
        since the split reads their index values)."""
        if self.cp == 1 or batch.get("context") is not None:
            return batch
        cp_rank, group = self.parallel.dims.cp_rank, self.parallel.group("cp")
        batch = split_batch(batch, self.cp, cp_rank, group, self.packed, self._split_count, self.sp_multiple)
        self._split_count += 1  # the same on every cp rank: they run the same micro-batches
        return batch

    def global_tokens(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        """The head objective's count (learned tokens; pairs) over the whole global batch (all micro-batches, all
        data-parallel ranks)."""
        n = sum(self.head.count(mb) for mb in micro_batches).to(self.device, torch.float32)
        if self.dp_group is not None:
            dist.all_reduce(n, group=self.dp_group)
        return n

    def forward_backward(
        self, micro_batches: list[dict[str, Any]], step: int = 0, n_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward of the step loss over ``micro_batches``; returns (the step objective over all ranks, global
        learned tokens).

        Gradients are left in ``.grad`` (under one-process O2 the fp32 masters' ``.grad``, slices of the main-grad
        buffer that ``MasterWeights``' hooks fill during backward), ready for clipping and the optimizer.
        ``step`` (the optimizer step) varies the LoRA dropout masks from step to step. ``n_tokens``: the batch's
        ``global_tokens`` when the caller already counted them.
        """
        if self.keyed_dropout:
            micro_batches = [
                {**mb, "dropout_keys": token_dropout_keys(mb["input_ids"], mb["position_ids"], step)}
                for mb in micro_batches
            ]
        if n_tokens is None:
            n_tokens = self.global_tokens(micro_batches)
        # Each micro-batch's summed loss enters the step objective with its weight (model.loss_normalization).
        # Data-parallel wrappers average gradients over replicas (dp × cp); backward scales by their number to make
        # that the sum.
        weight = functools.partial(
            micro_batch_weight,
            self.loss_normalization,
            global_tokens=n_tokens,
            micro_batches=len(micro_batches),
            dp_size=self.dp_size,
        )
        with self._loss_context():
            if self.parallel.runner is not None:  # each stage's objectives add their terms in its backward
                micro_batches = [self._prepare(mb) for mb in micro_batches]
                local = self.parallel.runner.forward_backward(
                    micro_batches,
                    weight,
                    self.grad_size,
                    self.sp_multiple,
                    head=self.pipeline_head(),
                    split=self._runner_split,
                )
            else:
                local = torch.zeros((), device=self.device)
                for i, mb in enumerate(micro_batches):
                    with self.parallel.sync_context(i == len(micro_batches) - 1):
                        loss = self.loss_sum(mb) * weight(mb["labels"])
                        for objective in self.objectives:  # this forward's term, weighted 1 / (micro-batches x dp)
                            loss = loss + objective.take(len(micro_batches) * self.dp_size)
                        (loss * self.grad_size).backward()
                    local += loss.detach()
        if self.parallel.manual_dp_sync:
            self.parallel.all_reduce_gradients(p for _, p in self.named_trainable_parameters())
        return self._step_total(local.detach().float().clone()), n_tokens

    def _step_total(self, total: torch.Tensor) -> torch.Tensor:
        """The step objective summed over data-parallel ranks; the objectives' metrics kept for ``aux_metrics``
        (device tensors: no host sync here, the rehearsal has no values). One all-reduce for the total and every
        objective's values."""
        values = []
        for objective in self.objectives:
            total, v = objective.step_values(total)
            values.append(v)
        flat = torch.cat([total.reshape(1), *values])
        if self.grad_group is not None:
            dist.all_reduce(flat, group=self.grad_group)
        self._aux_stats, offset = {}, 1
        for objective, v in zip(self.objectives, values):
            self._aux_stats.update(objective.metrics(flat[offset : offset + v.numel()]))
            offset += v.numel()
        return flat[0]

    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-weighted validation loss over ``micro_batches`` (all data-parallel ranks)."""
        if self.parallel.runner is not None and self.pipeline_head() is None:
            total = self.parallel.runner.evaluate(micro_batches, self.sp_multiple, split=self._runner_split)
        elif self.parallel.runner is not None:  # a head objective reads what its objectives prepare (the reference's)
            with self._loss_context():
                micro_batches = [self._prepare(mb) for mb in micro_batches]
                total = self.parallel.runner.evaluate(micro_batches, self.sp_multiple, head=self.pipeline_head())
        else:
            total = torch.zeros((), device=self.device)
            with self._loss_context():
                for mb in micro_batches:
                    total += self.loss_sum(mb).float()
        n_tokens = self.global_tokens(micro_batches)
        if self.grad_group is not None:
            dist.all_reduce(total, group=self.grad_group)
        return total / n_tokens.clamp(min=1.0), n_tokens

    def held_out_metrics(self) -> dict[str, float]:
        """The auxiliary objectives' metrics over the validation forwards since the last call (the preference stage's
        held-out rewards), each named ``val_<metric>``, summed over data-parallel ranks in one all-reduce; {} when no
        objective reports any. Every rank calls it after each validation."""
        found = [(o, v) for o in self.objectives if (v := o.held_out_values(self.device)) is not None]
        if not found:
            return {}
        flat = torch.cat([v.to(self.device, torch.float32) for _, v in found])
        if self.grad_group is not None:
            dist.all_reduce(flat, group=self.grad_group)
        out, offset = {}, 0
        for objective, v in found:
            out.update({f"val_{k}": float(x) for k, x in objective.metrics(flat[offset : offset + v.numel()]).items()})
            offset += v.numel()
        return out

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        micro_batches: list[dict[str, Any]],
        clip: float | None,
        step: int = 0,
        n_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One optimizer step over ``micro_batches``: forward/backward, clipping by the global norm when ``clip`` > 0,
        the optimizer step and the O2 publish. Returns (step objective, global learned tokens, norm before clipping
        or None). Reads no value on the host (the full-size rehearsal runs it on fake tensors)."""
        loss, n_tokens = self.forward_backward(micro_batches, step=step, n_tokens=n_tokens)
        grad_norm = self.clip_grad_norm(clip) if clip and clip > 0 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.after_optimizer_step()
        return loss, n_tokens, grad_norm

    def grad_params(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_trainable_parameters() if p.grad is not None)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every rank's shards (tensor, data and pipeline parallel); returns
        the norm before clipping (a 0-dim fp32 tensor on the device: reading it is the caller's one host sync).

        One foreach norm and one all-reduce for the whole model, then one foreach multiply by the clip coefficient
        (``neva.parallel.grad_norm``). ``max_norm`` <= 0 only measures it."""
        grads = [p.grad for p in self.grad_params()]
        norm = global_grad_norm(grads, self.parallel.dims, self.device)
        clip_grads_(grads, max_norm, norm)
        return norm
