"""The vision tower of a ``VisionConfig``: one class per ``kind`` behind one interface (``hidden_states(pixels,
num_layers)``, ``features(pixels)``, ``init_weights()``, attributes ``cfg``, ``patch_embed``, ``pos_embed``,
``layers``, ``post_norm``)."""

from __future__ import annotations

from torch import nn

from neva.models.config import VisionConfig
from neva.models.vision import VisionTower
from neva.models.vision_siglip import SiglipTower

TOWERS: dict[str, type[nn.Module]] = {"clip": VisionTower, "siglip": SiglipTower}


def build_tower(cfg: VisionConfig) -> nn.Module:
    return TOWERS[cfg.kind](cfg)
