"""Compute plans of decoder blocks: activation checkpointing (``model.activations_checkpoint_granularity``),
activation offload (``model.activation_offload``, ``neva.parallel.activation_offload``) and per-block
``torch.compile`` (``model.compile``).

``full`` recomputes a whole block in backward (only its input is kept). ``selective`` keeps every matmul output and
recomputes the rest — norms, activations and the attention core, whose ``S × S`` scores dominate activation memory
at long sequence lengths (NeMo's "selective" recomputes the core attention only).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from neva.config import ModelConfig
from neva.parallel.activation_offload import apply_activation_offload

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_contexts(selective: bool):
    """``context_fn`` for ``torch.utils.checkpoint`` under selective granularity: its save/recompute policy. (The
    recomputation replays the block's arguments, the per-token inputs among them: LoRA draws the same dropout masks
    and MoE routers count the same tokens with nothing to restore.)"""

    def context_fn():
        return create_selective_checkpoint_contexts(_selective_policy)

    return context_fn


def checkpointed_blocks(block_ids: list, granularity: str | None, num_layers: int | None) -> list:
    """The blocks of one model chunk that activation checkpointing wraps: its first ``num_layers`` (all when None).

    Per chunk, so with virtual pipeline stages every chunk of a rank checkpoints its own first blocks.
    """
    if granularity is None:
        return []
    return list(block_ids) if num_layers is None else list(block_ids)[:num_layers]


def apply_activation_checkpointing(layers: nn.ModuleDict, granularity: str | None, num_layers: int | None) -> None:
    """Wrap the first ``num_layers`` blocks of ``layers`` (all when None), in place.

    Wrapped parameter names gain ``_checkpoint_wrapped_module.``; state dicts drop it again (the wrapper's hooks),
    and ``neva.checkpoint.names.canonical_name`` strips it from parameter names.
    """
    for name in checkpointed_blocks(list(layers.keys()), granularity, num_layers):
        if granularity == "selective":
            layers[name] = checkpoint_wrapper(layers[name], context_fn=_checkpoint_contexts(True))
        else:
            layers[name] = checkpoint_wrapper(layers[name])


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """``model.compile``: ``auto`` compiles on CUDA only (there it fuses RMSNorm's fp32 round trip, RoPE, SwiGLU and
    the residual adds, ~20 % of a 7B step by bandwidth; on CPU compiling costs more than it gains)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def apply_compute_plans(model: nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    """Activation checkpointing, then ``torch.compile`` per decoder block, as ``model.*`` asks (any layout)."""
    apply_activation_checkpointing(
        model.llm.layers, cfg.activations_checkpoint_granularity, cfg.activations_checkpoint_num_layers
    )
    if cfg.activation_offload:  # after recomputation: a checkpointed block's saved input is what waits on the host
        apply_activation_offload(model.llm.layers)
    if compile_enabled(cfg.compile, device):
        for block in model.llm.layers.values():
            block.compile()
