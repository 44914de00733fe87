"""Tower work balanced over data-parallel ranks (``neva.data.patch_balance``) on a skewed set of image sizes: a
record's patches from its images' headers equal smart_resize's grid computed directly, the balanced deal spreads
them more evenly than the order's, and each step still trains on the same samples (resume unchanged)."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from neva.data.front_ends import NativeImages
from neva.data.images import FolderImageSource
from neva.data.patch_balance import rank_patches
from neva.data.sampler import ResumableBatchSampler
from neva.models.presets import build_config

# Side lengths of a skewed set: mostly small images, a few large ones, text-only records, a two-image record.
SIDES = [32, 32, 48, 32, 256, 32, 48, 0, 32, 160, 32, 32, 0, 64, 32, 224, 32, 48, 32, 32, 96, 32, 0, 256]
MIN_PIXELS, MAX_PIXELS = 16 * 16 * 4, 16 * 16 * 256  # tiny tower: 8 px patches merged 2 × 2 (a 16 px factor)


def _records(root):
    records = []
    for i, side in enumerate(SIDES):
        names = [] if side == 0 else [f"{i}.png"] + ([f"{i}b.png"] if i == 5 else [])
        for n, name in enumerate(names):
            Image.new("RGB", (side, side // 2 + 16 * n)).save(root / name)
        text = "".join("<image>\n" for _ in names) + "hi"
        records.append({"images": names, "conversations": [{"from": "human", "value": text}]})
    return records


def _direct_patches(side: int, height: int) -> int:
    """smart_resize (Qwen2-VL's rule) at factor 16, in 8 px patches, computed here from its definition."""
    h, w = max(16, round(height / 16) * 16), max(16, round(side / 16) * 16)
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * side / MAX_PIXELS)
        h, w = math.floor(height / beta / 16) * 16, math.floor(side / beta / 16) * 16
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * side))
        h, w = math.ceil(height * beta / 16) * 16, math.ceil(side * beta / 16) * 16
    return (h // 8) * (w // 8)


def test_balanced_deal_spreads_tower_patches_and_keeps_each_steps_samples(tmp_path):
    cfg = build_config("tiny", "tiny_qwen2_5_vl", projector_type="qwen2_5_vl_merger")
    front = NativeImages(cfg, MIN_PIXELS, MAX_PIXELS)
    source = FolderImageSource(str(tmp_path))
    records = _records(tmp_path)
    patches = [front.record_patches(r, source) for r in records]
    expected = [
        0 if s == 0 else _direct_patches(s, s // 2) + (_direct_patches(s, s // 2 + 16) if i == 5 else 0)
        for i, s in enumerate(SIDES)
    ]
    assert patches == expected

    dp, mbs = 4, 2
    plain = ResumableBatchSampler([len(records)], mbs, seed=3, dp_world=dp)
    order = plain.order(0)
    ratios = {"plain": [], "balanced": []}
    per_rank = {r: list(ResumableBatchSampler([len(records)], mbs, r, dp, seed=3, patches=patches)) for r in range(dp)}
    p = np.asarray(patches)
    for step in range(plain.num_steps):
        chunk = order[step * mbs * dp : (step + 1) * mbs * dp]
        balanced = np.concatenate([per_rank[r][step] for r in range(dp)])
        assert sorted(balanced) == sorted(chunk)  # the same samples: consumed counts and resuming are unchanged
        for name, dealt in (("plain", chunk), ("balanced", balanced)):
            loads = rank_patches(dealt, p, dp)
            ratios[name].append(loads.max() / loads.mean())
        assert ratios["balanced"][-1] <= ratios["plain"][-1]
    assert np.mean(ratios["balanced"]) < np.mean(ratios["plain"]) - 0.2, ratios
    # Fixed-size towers (no patches): the order's deal, as before.
    fixed = list(ResumableBatchSampler([len(records)], mbs, 1, dp, seed=3))
    assert fixed == [[int(i) for i in order[s * 8 + 2 : s * 8 + 4]] for s in range(plain.num_steps)]
    # Resumed after one step, rank 2 continues with the balanced deal of step 1 on.
    resumed = ResumableBatchSampler([len(records)], mbs, 2, dp, seed=3, patches=patches)
    resumed.advance(1)
    assert list(resumed) == per_rank[2][1:]
