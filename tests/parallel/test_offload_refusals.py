"""``model.fsdp_offload`` is FSDP2's policy: FSDP2 wraps the model for it (one process too, under a process group of
one), and DDP refuses it in one line naming the key; activation offload leaves a step's values unchanged (here on the CPU, where it moves nothing;
the DP2 step with both offloads: tests/parallel/test_headroom_layouts.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from neva.config import compose_config
from neva.errors import ConfigError
from neva.parallel.activation_offload import apply_activation_offload
from neva.parallel.layout import Layout
from neva.parallel.parallelize import check_offload_layout
from neva.parallel.precision import Precision


@pytest.mark.parametrize(
    "world,extra,refused",
    [(1, [], False), (2, [], False), (1, ["model.data_parallel=ddp"], True), (2, ["model.data_parallel=ddp"], True)],
)
def test_fsdp_offload_needs_fsdp2(world, extra, refused):
    cfg = compose_config(["+stage=pretrain", "model.fsdp_offload=true", "model.global_batch_size=32", *extra])
    layout = Layout.from_config(cfg.model, world)
    assert layout.is_distributed  # a process group, of one rank too
    if refused:
        with pytest.raises(ConfigError, match=r"model\.fsdp_offload"):
            check_offload_layout(True, layout, Precision.from_config("32", False))
    else:
        check_offload_layout(True, layout, Precision.from_config("32", False))


def test_activation_offload_keeps_values():
    torch.manual_seed(0)
    layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(8, 8), nn.GELU()) for i in range(2)})
    x = torch.randn(4, 8)
    grads = []
    for offload in (False, True):
        if offload:
            apply_activation_offload(layers)
        layers.zero_grad()
        layers["1"](layers["0"](x)).square().sum().backward()
        grads.append([p.grad.clone() for p in layers.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
