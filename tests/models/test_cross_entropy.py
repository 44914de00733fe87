"""The LM head's loss at learned positions (neva.models.loss.summed_cross_entropy) against F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from neva.models.loss import summed_cross_entropy


@pytest.mark.parametrize("rows", [0, 1, 130], ids=["empty", "one", "chunks"])  # 130: two full chunks and a remainder
def test_loss_and_gradient_equal_f_cross_entropy(rows):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, 1000, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, 1000, (rows,), generator=g)
    ref_logits = logits.detach().double().requires_grad_()
    expected = F.cross_entropy(ref_logits, targets, reduction="sum")
    (expected * 0.37).backward()  # backward scales by its incoming gradient
    got = summed_cross_entropy(logits * 1.0, targets)  # consumes its input: a copy, so logits.grad is a leaf's
    (got * 0.37).backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-7)


def test_runs_backward_once_and_takes_fp32_only():
    logits = torch.randn(3, 7, requires_grad=True)
    loss = summed_cross_entropy(logits * 1.0, torch.tensor([0, 6, 2]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()
    with pytest.raises(TypeError, match="fp32"):
        summed_cross_entropy(logits.detach().bfloat16(), torch.tensor([0, 6, 2]))


def test_an_autograd_node_that_saved_the_logits_fails_loudly():
    """The logits are overwritten with the gradient: a consumer that saved them must not silently read garbage."""
    logits = torch.randn(3, 7, requires_grad=True)
    shared = logits * 1.0
    other = (shared * shared).sum()  # saves ``shared`` for its backward
    loss = summed_cross_entropy(shared, torch.tensor([0, 6, 2]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()
