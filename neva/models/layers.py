"""Building blocks shared by the vision encoder and the decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (HF ``LlamaRMSNorm`` order, so bf16 results match)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "silu": F.silu}


def build_attention_mask(segment_ids: torch.Tensor, q_len: int, offset: int = 0) -> torch.Tensor:
    """Boolean SDPA mask ``[B, 1, q_len, K]``: causal, and only within the same segment.

    ``segment_ids`` ``[B, K]`` labels every key position (cached + new); queries are positions
    ``offset .. offset + q_len``. Padding carries segment 0 and so only sees padding, which keeps every query row
    non-empty (no NaNs from an all-masked softmax).
    """
    keys = segment_ids.shape[1]
    seg_q = segment_ids[:, offset : offset + q_len]
    same = seg_q[:, :, None] == segment_ids[:, None, :]
    q_pos = torch.arange(offset, offset + q_len, device=segment_ids.device)
    causal = torch.arange(keys, device=segment_ids.device)[None, :] <= q_pos[:, None]
    return (same & causal)[:, None]
