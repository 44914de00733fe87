"""One rule names a LoRA model's tensors plainly: the base's keys as without LoRA, the adapters' own none."""

from __future__ import annotations

import torch
from torch import nn

from neva.models.lora import LoRALinear, merged_state_dict, plain_key, split_state_dict


def _block() -> nn.Module:
    torch.manual_seed(0)
    block = nn.Module()
    block.attention = nn.Module()
    block.attention.wq = nn.Linear(4, 4)
    block.attention.base = nn.Linear(4, 4)  # a module named "base" outside a LoRA layer keeps its key
    block.norm = nn.LayerNorm(4)
    return block


def test_plain_keys_are_the_keys_without_lora():
    plain = _block()
    wrapped = _block()
    wrapped.attention.wq = LoRALinear(wrapped.attention.wq, rank=2, alpha=4.0)
    owners = {"attention.wq"}
    keys = [plain_key(k, owners) for k in wrapped.state_dict()]
    assert [k for k in keys if k is not None] == list(plain.state_dict())
    assert plain_key("attention.wq.lora_a.weight", owners) is None
    assert plain_key("attention.wq.lora_b.weight", owners) is None
    assert plain_key("attention.wqx.base.weight", owners) == "attention.wqx.base.weight"

    base, layers = split_state_dict(wrapped)
    assert list(base) == list(plain.state_dict()) and list(layers) == ["attention.wq"]
    nn.init.normal_(wrapped.attention.wq.lora_b.weight)
    layer = wrapped.attention.wq
    expected = layer.base.weight + layer.scale * layer.lora_b.weight @ layer.lora_a.weight
    torch.testing.assert_close(merged_state_dict(wrapped)["attention.wq.weight"], expected.detach())
