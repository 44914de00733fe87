"""LoRA adapters: wrap selected ``nn.Linear`` layers; merge back into plain weights for export.

Adapter dropout is keyed: with ``dropout_keys`` given (training does), a token's mask is a hash of its sample's token
ids, its position in the sample, the step and the layer, not a draw from the process's RNG stream. The same sample
then gets the same mask whichever micro-batch, row, data-parallel rank or pipeline schedule carries it, so LoRA keeps
"every layout equals one process".
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Collection, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from neva.models.token_inputs import NO_TOKEN_INPUTS, TokenInputs

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: products of 32-bit values stay inside int64


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply–xorshift rounds), elementwise on int64 tensors."""
    h = h & _M32
    h = ((h ^ (h >> 16)) * _MUL) & _M32
    h = ((h ^ (h >> 16)) * _MUL) & _M32
    return h ^ (h >> 16)


def token_dropout_keys(input_ids: torch.Tensor, position_ids: torch.Tensor, step: int) -> torch.Tensor:
    """Per-token keys ``[B, S]``: a hash of the token's sample (all its token ids), its position and ``step``.

    Samples are found by their positions restarting at 0 (packed rows and padding alike); padding tokens form
    samples of their own, so padding never changes a real sample's key.
    """
    # The first position axis ([P, B, S]; a [B, S] tensor is one axis): it restarts at 0 with every sample.
    ids, pos = input_ids.long(), position_ids.reshape(-1, *input_ids.shape)[0].long()
    b, s = ids.shape
    sample = torch.cumsum(pos == 0, dim=1) + torch.arange(b, device=ids.device)[:, None] * (s + 1)
    contrib = _mix(ids * 0x9E3779B1 + pos)
    sums = torch.zeros(b * (s + 1), dtype=torch.long, device=ids.device).index_add_(
        0, sample.reshape(-1), contrib.reshape(-1)
    )
    sample_hash = sums[sample]
    return _mix(_mix(sample_hash + step * 0x27D4EB2F) ^ pos)


def keyed_dropout_mask(keys: torch.Tensor, features: int, salt: int, p: float) -> torch.Tensor:
    """Keep-mask ``[B, S, features]`` with keep probability ``1 - p``, a pure function of keys, feature and salt."""
    feature = _mix(torch.arange(features, device=keys.device) + salt * 0x1000193)
    h = _mix(keys[..., None] ^ feature)
    return h >= int(p * 2**32)


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(dropout(x)))`` with ``A`` ``[r, in]`` (Kaiming) and ``B`` ``[out, r]`` (zeros).

    Its dropout is keyed by the forward's ``TokenInputs.dropout_keys``, which the layer calling it hands on
    (``neva.models.token_inputs.project``)."""

    reads_token_inputs = True

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, salt: int = 0) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.p = dropout
        self.salt = salt  # distinguishes the layers' masks (a hash of the wrapped module's name)
        self.enabled = True  # False: the base layer alone (``adapters_disabled``)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        if base.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor, token_inputs: TokenInputs = NO_TOKEN_INPUTS) -> torch.Tensor:
        if not self.enabled:
            return self.base(x)
        return self.base(x) + self.lora_b(self.lora_a(self._dropout(x, token_inputs.dropout_keys))) * self.scale

    def _dropout(self, x: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if keys is None:
            return F.dropout(x, self.p, training=True)
        return x * keyed_dropout_mask(keys, x.shape[-1], self.salt, self.p).to(x.dtype) / (1 - self.p)

    def merged_weight(self, value: Callable[[nn.Parameter], torch.Tensor] | None = None) -> torch.Tensor:
        """``W + scale · B A`` in fp32; ``value`` reads each parameter (default: as it is; the export passes one that
        gathers shards and prefers fp32 master copies)."""
        value = value or (lambda p: p.detach())
        w, a, b = (value(p).float() for p in (self.base.weight, self.lora_a.weight, self.lora_b.weight))
        return w + self.scale * b @ a


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every LoRA layer of ``model`` runs its base layer alone: the model as it was before its adapters,
    without a second copy of it (PEFT's ``disable_adapter``)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float) -> list[str]:
    """Replace every ``nn.Linear`` inside ``model.llm.layers`` whose attribute name is in ``targets``.

    Only base weights freeze here; the caller decides what else trains. Returns the wrapped module names.
    """
    wrapped = []
    for name, module in list(model.llm.layers.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                child.weight.requires_grad_(False)
                full = f"llm.layers.{name}.{child_name}"
                setattr(module, child_name, LoRALinear(child, rank, alpha, dropout, salt=zlib.crc32(full.encode())))
                wrapped.append(full)
    if not wrapped:
        raise ValueError(f"LoRA target modules {targets} matched no Linear layer of the decoder")
    return wrapped


def plain_key(key: str, lora_owners: Collection[str]) -> str | None:
    """The plain key of model tensor ``key`` (the merged export's, the HF tables' and a checkpoint's name for it).

    ``lora_owners``: the plain module names of the model's LoRA layers. A LoRA layer's base tensors
    ``<owner>.base.<t>`` are ``<owner>.<t>`` (the merged weight of ``<owner>.base.weight``); the adapters' own tensors
    (``<owner>.lora_a.weight``, ``<owner>.lora_b.weight``) have no plain key (None): they are merged into the base
    weight or exported apart. Every other key is its own plain key. The one place this rule lives: the export's
    consolidation, step-checkpoint conversion, the PEFT export and the weight loaders all call it.
    """
    parts = key.split(".")
    for i in range(1, len(parts)):
        owner = ".".join(parts[:i])
        if owner in lora_owners:
            return f"{owner}.{'.'.join(parts[i + 1 :])}" if parts[i] == "base" else None
    return key


def merged_key(owner: str) -> str:
    """The plain key of LoRA layer ``owner``'s merged weight ``W + scale · B A``."""
    return f"{owner}.weight"


def split_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, LoRALinear]]:
    """The base model's state dict under plain (un-wrapped) keys, LoRA not applied, and the LoRA layers by their plain
    module name: what a merged export folds together and a PEFT adapter export keeps apart."""
    lora_layers = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    base = {}
    for key, value in model.state_dict().items():
        plain = plain_key(key, lora_layers)
        if plain is not None:
            base[plain] = value
    return base, lora_layers


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with every LoRA layer folded into its base weight, under the plain (un-wrapped) key names."""
    merged, lora_layers = split_state_dict(model)
    for owner, layer in lora_layers.items():
        key = merged_key(owner)
        merged[key] = layer.merged_weight().to(merged[key].dtype)
    return merged
