"""Visual features on their way to the decoder's positions, one structure for every tower."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class VisualFeatures:
    """The features of a micro-batch's visual positions: what a patch-grid tower hands its merger, what a projector
    (or merger) hands the decoder for any tower — fixed-size images, AnyRes tiles and frames flattened to one row per
    position, with no per-layer additions (``deepstack`` empty).

    From the tower (``features``): ``main`` ``[L, hidden]``, the last block's output per patch in the processor's
    order; ``deepstack`` one ``[L, hidden]`` per ``VisionConfig.deepstack_visual_indexes`` (Qwen3-VL: that block's
    output; empty for the other kinds). From the merger: ``main`` ``[L / merge², llm_hidden]`` one row per LLM
    token, ``deepstack`` one such tensor per DeepStack merger (what HF adds to the first decoder layers' hidden states
    at the visual positions).
    """

    main: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)

    def rows(self, index: torch.Tensor) -> VisualFeatures:
        """The rows ``index`` of every tensor (``MediaInputs.feature_rows``: positions sharing an item's features)."""
        return VisualFeatures(self.main.index_select(0, index), [d.index_select(0, index) for d in self.deepstack])
