"""Building blocks shared by the vision encoder and the decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNormFP32(torch.autograd.Function):
    """fp32 RMSNorm with a hand-written backward: one ``[.., D]`` allocation forward (the composite makes four), the
    row statistic from one norm pass, and the backward's products in place (about half the time per call on the CPU
    benchmark). Plain tensors only: sharded (DTensor) and low-precision inputs take the composite."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dim = x.shape[-1]
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(dim).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x * rstd
        grad_weight = (grad * normed).sum(dim=tuple(range(grad.dim() - 1)))
        grad_normed = grad * weight
        # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat)).
        mean = (grad_normed * normed).sum(dim=-1, keepdim=True).div_(x.shape[-1])
        return normed.mul_(mean.neg_()).add_(grad_normed).mul_(rstd), grad_weight, None


def fp32_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor | None:
    """``x`` normalised over its last dimension times ``weight + offset`` by ``_RMSNormFP32`` where ``x`` and
    ``weight`` are plain fp32 tensors; None otherwise (sharded or low-precision inputs: the caller's composite)."""
    if type(x) is torch.Tensor and type(weight.data) is torch.Tensor and x.dtype == weight.dtype == torch.float32:
        return _RMSNormFP32.apply(x, weight + offset if offset else weight, eps)
    return None


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (HF ``LlamaRMSNorm`` order, so bf16 results match).

    ``offset`` 1 is Gemma's and Qwen3.5's: scale by ``1 + w`` (weights centred on 0, so weight decay pulls the scale
    towards 1; Megatron's ``layernorm_zero_centered_gamma``) in fp32, then cast (HF ``Gemma3RMSNorm``,
    ``Qwen3_5RMSNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fp32_rms_norm(x, self.weight, self.eps, self.offset)
        if fused is not None:
            return fused
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:  # Gemma: 1 + w and the product in fp32 (bf16 weights would round 1 + w), then the cast
            return (normed * (self.weight.float() + self.offset)).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 - self.offset)


class _SwiGLUFP32(torch.autograd.Function):
    """``silu(gate) * up`` saving only its two inputs: the composite also keeps ``silu(gate)`` (one more
    ``[.., intermediate]`` activation per layer) and allocates one more buffer each way. The backward recomputes
    ``silu(gate)`` and applies the same ops as the composite's autograd (``mul``, ``silu_backward``), so results
    are bitwise equal."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = F.silu(gate).mul_(grad)
        grad_gate = grad * up
        return torch.ops.aten.silu_backward(grad_gate, gate, grad_input=grad_gate), grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: by ``_SwiGLUFP32`` for plain fp32 tensors that need gradients (sharded and
    low-precision inputs, and compiled graphs, which fuse the composite, take the composite)."""
    if (
        type(gate) is torch.Tensor
        and type(up) is torch.Tensor
        and gate.dtype == up.dtype == torch.float32
        and gate.shape == up.shape
        and torch.is_grad_enabled()
        and (gate.requires_grad or up.requires_grad)
        and not torch.compiler.is_compiling()
    ):
        return _SwiGLUFP32.apply(gate, up)
    return F.silu(gate) * up


def gelu_tanh_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up``: Gemma's gated feed-forward."""
    return F.gelu(gate, approximate="tanh") * up


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF ``gelu_pytorch_tanh`` (SigLIP's MLP)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}
