"""The vision tower of a ``VisionConfig``: the class its family names (``neva.families``, ``TowerSpec.tower``).

Every tower has ``features``, ``empty_input()``, ``init_weights()``, ``cfg``, ``patch_embed`` and ``layers``. A
fixed-size tower (CLIP, SigLIP) takes ``features(pixels)`` → ``[N, tokens, width]`` and has ``hidden_states(pixels,
num_layers)``, ``pos_embed`` and ``post_norm``; a patch-grid tower (the family's ``patch_grid``: the Qwen towers) takes
``features(pixels, grid)`` → ``VisualFeatures`` (``neva.models.native_vision``)."""

from __future__ import annotations

from torch import nn

from neva.families import part
from neva.models.config import VisionConfig


def build_tower(cfg: VisionConfig) -> nn.Module:
    return part(cfg.spec.tower)(cfg)
