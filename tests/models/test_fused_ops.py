"""Hand-written autograd of RoPE, fp32 RMSNorm and fp32 SwiGLU against the composite PyTorch expressions they
replace (outputs and gradients of every input: float64 references; SwiGLU bitwise against fp32 autograd)."""

import functools

import torch
import torch.nn.functional as F

from neva.models.layers import RMSNorm, swiglu
from neva.models.rope import apply_rope

# fp32 results against float64 references.
close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)


def _grads(fn, *inputs):
    out = fn(*inputs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return out.detach(), torch.autograd.grad((out * w).sum(), inputs)


def test_rope_equals_rotate_half_composite():
    g = torch.Generator().manual_seed(0)
    # [B, S, H, D] viewed as [B, H, S, D], as the attention layer hands q and k over (a strided view).
    x = torch.randn(2, 9, 3, 8, generator=g).transpose(1, 2).requires_grad_()
    angles = torch.randn(2, 1, 9, 4, generator=g) * 3
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def composite(x):
        half = x.shape[-1] // 2
        return x * cos.double() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin.double()

    got, (grad,) = _grads(lambda x: apply_rope(x, cos, sin), x)
    want, (want_grad,) = _grads(composite, x.detach().double().requires_grad_())
    close(got.double(), want)
    close(grad.double(), want_grad)


def test_fp32_rms_norm_equals_composite():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
    x = (torch.randn(2, 5, 16, generator=g) * 3).requires_grad_()
    got, (gx, gw) = _grads(lambda x, w: norm(x), x, norm.weight)

    def composite(x, w):
        return w * F.rms_norm(x, (16,), eps=1e-5)

    want, (want_gx, want_gw) = _grads(
        composite, x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    )
    close(got.double(), want)
    close(gx.double(), want_gx)
    close(gw.double(), want_gw)


def test_fp32_swiglu_is_bitwise_the_composite():
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(3, 7, 16, generator=g) * 3).requires_grad_(), torch.randn(3, 7, 16, generator=g)
    up.requires_grad_()
    got, got_grads = _grads(swiglu, gate, up)
    want, want_grads = _grads(lambda a, b: F.silu(a) * b, gate, up)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
