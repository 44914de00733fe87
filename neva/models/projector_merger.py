"""The native towers' patch mergers as projectors (a family's ``MergerSpec.projector``, ``neva.families``).

HF ``PatchMerger`` (Qwen2-VL), ``Qwen2_5_VLPatchMerger`` and ``Qwen3VLVisionPatchMerger``: a norm over each patch
(LayerNorm or RMSNorm, eps 1e-6), then ``spatial_merge_size``² consecutive patches (one merge block, the processor's
order) viewed as one vector, Linear, exact GELU, Linear to the LLM width. Qwen3-VL's DeepStack mergers take one
hidden state each and norm after the merge (LayerNorm over the merged vector: HF ``use_postshuffle_norm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neva.families import merger_spec
from neva.models.config import ProjectorConfig
from neva.models.features import VisualFeatures
from neva.models.native_vision import make_norm


class PatchMerger(nn.Module):
    """``norm``, merge, ``fc1``, GELU, ``fc2``: ``[L, input_size]`` → ``[L / merge², output_size]``."""

    def __init__(self, cfg: ProjectorConfig, norm: str, post_merge_norm: bool) -> None:
        super().__init__()
        self.width = cfg.input_size * cfg.spatial_merge_size**2
        self.post_merge_norm = post_merge_norm
        self.norm = make_norm(norm, self.width if post_merge_norm else cfg.input_size, 1e-6)
        self.fc1 = nn.Linear(self.width, self.width, bias=cfg.bias)
        self.fc2 = nn.Linear(self.width, cfg.output_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.post_merge_norm else self.norm(x).reshape(-1, self.width)
        return self.fc2(F.gelu(self.fc1(x)))


class NativeMerger(nn.Module):
    """A native tower's projector: ``merger`` over its last block, and ``deepstack.{i}`` over the i-th DeepStack
    hidden state (Qwen3-VL). ``forward(VisualFeatures)`` → ``VisualFeatures`` of LLM tokens (see its docstring)."""

    def __init__(self, cfg: ProjectorConfig) -> None:
        super().__init__()
        self.merger = PatchMerger(cfg, merger_spec(cfg.type).merger.norm, post_merge_norm=False)
        self.deepstack = nn.ModuleList(PatchMerger(cfg, "layer", True) for _ in range(cfg.deepstack_mergers))

    def forward(self, features: VisualFeatures) -> VisualFeatures:
        if len(features.deepstack) != len(self.deepstack):
            raise ValueError(f"{len(features.deepstack)} DeepStack features for {len(self.deepstack)} mergers")
        return VisualFeatures(
            self.merger(features.main), [merge(x) for merge, x in zip(self.deepstack, features.deepstack)]
        )
