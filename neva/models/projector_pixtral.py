"""Mistral 3's projector over Pixtral's patches (HF ``Mistral3MultiModalProjector``), the pixtral family's merger.

``norm`` (RMSNorm over each patch, at the decoder's ``rms_norm_eps``: ``ProjectorConfig.norm_eps``), then each 2×2
block of an image's patch grid as one vector through ``merging_layer`` (bias-free Linear 4·D → D), then ``linear_1``,
exact GELU, ``linear_2`` (biased as HF's ``multimodal_projector_bias``). HF's merge is ``unfold`` over the
(channel, row, column) grid: the merged vector lists each channel's four patches together (channel outer, then the
block's row, then its column). The tower hands the patches in merge-block order (a block's four patches
consecutive, row-major), so the block is ``[4, D]`` here, transposed to HF's ``[D, 4]``.

The children are in the order they run, the Linear layers alternating column- and row-wise under tensor parallelism
(``neva.parallel.tensor_parallel``: no activation between ``merging_layer`` and ``linear_1``, so the pair is one
column-then-row split).
"""

from __future__ import annotations

from torch import nn

from neva.models.config import ProjectorConfig
from neva.models.features import VisualFeatures
from neva.models.layers import RMSNorm


class PixtralMerger(nn.Module):
    """``VisualFeatures`` of patches ``[L, D]`` → of LLM tokens ``[L / merge², output_size]``."""

    def __init__(self, cfg: ProjectorConfig) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size**2
        self.norm = RMSNorm(cfg.input_size, eps=cfg.norm_eps)
        self.merging_layer = nn.Linear(cfg.input_size * self.merge, cfg.input_size, bias=False)
        self.linear_1 = nn.Linear(cfg.input_size, cfg.output_size, bias=cfg.bias)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(cfg.output_size, cfg.output_size, bias=cfg.bias)

    def forward(self, features: VisualFeatures) -> VisualFeatures:
        if features.deepstack:
            raise ValueError("the pixtral merger takes no DeepStack features")
        x = self.norm(features.main)
        x = x.view(-1, self.merge, x.shape[-1]).transpose(1, 2).flatten(1)  # channel outer, the block's patches inner
        return VisualFeatures(self.linear_2(self.act(self.linear_1(self.merging_layer(x)))))
