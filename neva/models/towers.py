"""The vision tower of a ``VisionConfig``: one class per ``kind`` behind one interface (``hidden_states(pixels,
num_layers)``, ``features(pixels)``, ``init_weights()``, attributes ``cfg``, ``patch_embed``, ``pos_embed``,
``layers``, ``post_norm``).

A native-resolution kind (``VisionConfig.is_native``: the Qwen towers) has ``features(pixels, grid)`` →
``NativeFeatures`` instead (``neva.models.native_vision``), ``empty_input``, ``init_weights``, ``cfg``,
``patch_embed``, ``layers`` (Qwen3-VL: ``pos_embed`` too); no ``hidden_states``, no ``post_norm``."""

from __future__ import annotations

from torch import nn

from neva.models.config import VisionConfig
from neva.models.vision import VisionTower
from neva.models.vision_qwen2 import Qwen2Tower
from neva.models.vision_qwen3 import Qwen3Tower
from neva.models.vision_siglip import SiglipTower

TOWERS: dict[str, type[nn.Module]] = {
    "clip": VisionTower,
    "siglip": SiglipTower,
    "qwen2_vl": Qwen2Tower,
    "qwen2_5_vl": Qwen2Tower,
    "qwen3_vl": Qwen3Tower,
}


def build_tower(cfg: VisionConfig) -> nn.Module:
    return TOWERS[cfg.kind](cfg)
