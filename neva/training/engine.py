"""One optimizer step's worth of forward/backward, the same for every layout.

The loss of a step is the sum of token cross-entropies over all micro-batches of all data-parallel ranks divided
by the number of learned tokens in that whole global batch. Gradient accumulation and every parallel layout then
compute the same update as one process running the whole global batch (a per-micro-batch mean would weight
tokens differently whenever micro-batches hold different numbers of learned tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from neva.training.loss import count_learned_tokens, learned_positions, token_cross_entropy
from neva.training.precision import MasterWeights, Precision

MODEL_INPUTS = ("input_ids", "pixel_values", "image_counts", "position_ids", "segment_ids")


def model_inputs(batch: dict[str, Any], device: torch.device, packed: bool = True) -> dict[str, Any]:
    """The model's keyword inputs from a collated micro-batch, on ``device``.

    Unpacked, right-padded batches drop ``segment_ids``: padding sits after every real token, so plain causal
    attention gives the same result for the real tokens and lets SDPA use its fastest kernel.
    """
    out = {}
    for key in MODEL_INPUTS:
        value = batch.get(key)
        if key == "segment_ids" and not packed:
            continue
        out[key] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
    return out


class Engine:
    """Runs forward/backward for a list of micro-batches and owns what the optimizer steps.

    Args:
        model: the (possibly parallelized) NevaModel.
        precision: fp32 / bf16 autocast / bf16 O2.
        device: where inputs go.
        dp_group: process group of the data-parallel replicas (None = one replica).
        master: O2 master weights when the data-parallel wrapper does not provide them (FSDP2 does).
        sync_context: ``sync_context(is_last)`` returns a context in which backward runs; data-parallel wrappers
            use it to skip gradient reduction on all but the last micro-batch.
        forward_backward_fn: replaces the micro-batch loop (pipeline parallelism runs its schedule there); called as
            ``fn(micro_batches, scale) -> loss_sum`` and must call backward itself.
    """

    def __init__(
        self,
        model: nn.Module,
        precision: Precision,
        device: torch.device,
        dp_group: dist.ProcessGroup | None = None,
        master: MasterWeights | None = None,
        sync_context: Callable[[bool], contextlib.AbstractContextManager] | None = None,
        forward_backward_fn: Callable[[list[dict], float], torch.Tensor] | None = None,
        packed: bool = False,
    ) -> None:
        self.model = model
        self.precision = precision
        self.device = device
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.master = master
        self.sync_context = sync_context or (lambda is_last: contextlib.nullcontext())
        self.forward_backward_fn = forward_backward_fn
        self.packed = packed
        # LM head only at learned positions; layouts whose logits are sharded or split turn this off.
        self.learned_only_head = True

    # -- what the optimizer sees -------------------------------------------------------------------------------
    def named_trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        if self.master is not None:
            return self.master.named_master
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def after_optimizer_step(self) -> None:
        if self.master is not None:
            self.master.publish()

    # -- compute -----------------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.autocast_dtype)

    def loss_sum(self, batch: dict[str, Any]) -> torch.Tensor:
        """Summed token loss of one micro-batch (forward only)."""
        inputs = model_inputs(batch, self.device, self.packed)
        labels = batch["labels"].to(self.device)
        if not self.learned_only_head:
            with self._autocast():
                logits = self.model(**inputs)
            return token_cross_entropy(logits, labels)[0]
        output_mask, targets = learned_positions(labels)
        with self._autocast():
            logits = self.model(**inputs, output_mask=output_mask)
        return F.cross_entropy(logits.float(), targets, reduction="sum")

    def global_tokens(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        """Learned tokens of the whole global batch (all micro-batches, all data-parallel ranks)."""
        n = sum(count_learned_tokens(mb["labels"]) for mb in micro_batches).to(self.device, torch.float32)
        if self.dp_group is not None:
            dist.all_reduce(n, group=self.dp_group)
        return n

    def forward_backward(self, micro_batches: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward of the step loss over ``micro_batches``; returns (global loss, global learned tokens).

        Gradients are left in ``.grad`` (fp32 master ``.grad`` under O2), ready for clipping and the optimizer.
        """
        n_tokens = self.global_tokens(micro_batches)
        # Data-parallel wrappers average gradients over replicas; scaling by dp_size turns that into the sum.
        scale = self.dp_size / n_tokens.clamp(min=1.0)
        if self.forward_backward_fn is not None:
            local = self.forward_backward_fn(micro_batches, scale)
        else:
            local = torch.zeros((), device=self.device)
            for i, mb in enumerate(micro_batches):
                with self.sync_context(i == len(micro_batches) - 1):
                    loss = self.loss_sum(mb)
                    (loss * scale).backward()
                local += loss.detach()
                if self.master is not None:
                    self.master.accumulate()
        total = local.detach().float().clone()
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return total / n_tokens.clamp(min=1.0), n_tokens

    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-weighted validation loss over ``micro_batches`` (all data-parallel ranks)."""
        total = torch.zeros((), device=self.device)
        for mb in micro_batches:
            total += self.loss_sum(mb).float()
        n_tokens = self.global_tokens(micro_batches)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return total / n_tokens.clamp(min=1.0), n_tokens

    def grad_params(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_trainable_parameters() if p.grad is not None)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm (over all parameters of all ranks); returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(list(self.grad_params()), max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):  # DTensor parameters give a DTensor norm
            norm = norm.full_tensor()
        return float(norm)
