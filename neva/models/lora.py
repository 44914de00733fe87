"""LoRA adapters: wrap selected ``nn.Linear`` layers; merge back into plain weights for export."""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(dropout(x)))`` with ``A`` ``[r, in]`` (Kaiming) and ``B`` ``[out, r]`` (zeros)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if base.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scale

    def merged_weight(self) -> torch.Tensor:
        delta = self.lora_b.weight.float() @ self.lora_a.weight.float()
        return (self.base.weight.float() + self.scale * delta).to(self.base.weight.dtype)


def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float) -> list[str]:
    """Replace every ``nn.Linear`` inside ``model.llm.layers`` whose attribute name is in ``targets``.

    Only base weights freeze here; the caller decides what else trains. Returns the wrapped module names.
    """
    wrapped = []
    for name, module in list(model.llm.layers.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                child.weight.requires_grad_(False)
                setattr(module, child_name, LoRALinear(child, rank, alpha, dropout))
                wrapped.append(f"llm.layers.{name}.{child_name}")
    if not wrapped:
        raise ValueError(f"LoRA target modules {targets} matched no Linear layer of the decoder")
    return wrapped


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with every LoRA layer folded into its base weight, under the plain (un-wrapped) key names."""
    merged = {}
    lora_prefixes = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    for key, value in model.state_dict().items():
        owner = next((p for p in lora_prefixes if key.startswith(p + ".")), None)
        if owner is None:
            merged[key] = value
        elif key == f"{owner}.base.weight":
            merged[f"{owner}.weight"] = lora_prefixes[owner].merged_weight().detach()
        elif key.startswith(f"{owner}.base."):
            merged[f"{owner}.{key[len(owner) + 6 :]}"] = value
    return merged
