"""Gated DeltaNet's depthwise causal convolution in channels-last order (``neva.models.packed_rows``): its hand-written
backward against numerical gradients (fp64), and its outputs and gradients against ``torch.nn.functional.conv1d``
on the channels-first copy with ``K - 1`` zeros before each row (fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neva.models.packed_rows import _CausalConvLast, causal_conv_last
from tests.models.test_hf_parity import rel_err


def test_backward_equals_numerical_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    filters = torch.randn(3, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_CausalConvLast.apply, (x, filters))


def test_equals_conv1d_on_the_channels_first_copy():
    """Rows shorter than, as long as and longer than the filter (2, 4 and 33 positions)."""
    g = torch.Generator().manual_seed(1)
    filters = torch.randn(5, 1, 4, generator=g, requires_grad=True)
    for length in (2, 4, 33):
        x = torch.randn(2, length, 5, generator=g, requires_grad=True)
        ours = causal_conv_last(x, filters)
        theirs = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), filters, groups=5).transpose(1, 2)
        assert rel_err(ours, theirs) < 1e-6
        weights = torch.randn(ours.shape, generator=g)
        ours_grads = torch.autograd.grad((ours * weights).sum(), (x, filters))
        their_grads = torch.autograd.grad((theirs * weights).sum(), (x, filters))
        for a, b in zip(ours_grads, their_grads):
            assert rel_err(a, b) < 1e-6
