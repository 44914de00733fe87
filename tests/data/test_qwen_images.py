"""Native-resolution patches against transformers' ``Qwen2VLImageProcessorPil`` (the PIL backend of
``Qwen2VLImageProcessor``, which Qwen2.5-VL and Qwen3-VL use with their settings): resized sizes, grids and pixels
after the tower's normalisation, on images of several aspect ratios and sizes, some clamped by min_pixels or
max_pixels; the token count from an image's size alone; a video's patch order against the formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from neva.data.images import ImageError
from neva.data.qwen_images import (
    QwenImageSpec,
    flatten_patches,
    image_patches,
    image_token_count,
    smart_resize,
    video_patches,
    video_token_count,
)
from neva.models.config import VisionConfig
from neva.models.native_vision import normalize_patches

# (tower kind, patch size, min_pixels, max_pixels, image sizes as (height, width))
CASES = [
    ("qwen2_vl", 14, None, None, [(100, 150), (37, 301), (480, 64), (20, 20), (1200, 900)]),
    ("qwen2_5_vl", 14, 56 * 56, 28 * 28 * 64, [(333, 517), (64, 1000), (30, 40), (900, 1200)]),
    ("qwen3_vl", 16, None, 32 * 32 * 120, [(255, 257), (40, 700), (17, 23), (600, 800)]),
]


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("kind, patch, min_pixels, max_pixels, sizes", CASES, ids=[c[0] for c in CASES])
def test_patches_and_grid_match_transformers(kind, patch, min_pixels, max_pixels, sizes):
    cfg = VisionConfig(kind=kind, patch_size=patch, hidden_size=32, num_heads=2, intermediate_size=64, num_layers=1,
                       hidden_act={"qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu"}.get(kind, "gelu_pytorch_tanh"))  # fmt: skip
    spec = QwenImageSpec.for_tower(cfg, min_pixels, max_pixels)
    hf = Qwen2VLImageProcessorPil(
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
    )
    images = [random_image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    ref = hf(images=images, return_tensors="pt")
    mine = [image_patches(image, spec) for image in images]
    grids = torch.cat([g for _, g in mine])
    assert torch.equal(grids, ref["image_grid_thw"])
    pixels = torch.cat([p for p, _ in mine])
    assert pixels.dtype == torch.uint8 and pixels.shape == ref["pixel_values"].shape
    assert (normalize_patches(pixels, cfg, torch.float32) - ref["pixel_values"]).abs().max() <= 1e-5
    for (h, w), grid in zip(sizes, grids):
        assert image_token_count(spec, h, w) == int(grid.prod()) // 4
    # The cases clamp: at least one image grew to min_pixels and one shrank to max_pixels.
    areas = [int(g[1] * g[2]) * patch * patch for g in grids]
    assert min(areas) >= spec.min_pixels and max(areas) <= spec.max_pixels
    native = [round(h / spec.factor) * round(w / spec.factor) * spec.factor**2 for h, w in sizes]
    assert any(n < spec.min_pixels for n in native) and any(n > spec.max_pixels for n in native)


def test_video_patches_group_frames_and_repeat_the_last():
    spec = QwenImageSpec(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=10**6)
    frames = [random_image(16, 24, seed) for seed in range(3)]
    patches, grid = video_patches(frames, spec)
    assert grid.tolist() == [[2, 4, 6]] and patches.shape == (48, 3 * 2 * 4 * 4)
    assert video_token_count(spec, 3, 16, 24) == 12
    video = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in frames])
    video = torch.cat([video, video[-1:]])  # the last frame repeated to fill the last group
    row = 0
    for t in range(2):
        for bh in range(2):
            for bw in range(3):
                for ih in range(2):
                    for iw in range(2):
                        y, x = (bh * 2 + ih) * 4, (bw * 2 + iw) * 4
                        expected = video[2 * t : 2 * t + 2, :, y : y + 4, x : x + 4].permute(1, 0, 2, 3).flatten()
                        assert torch.equal(patches[row], expected)
                        row += 1
    single, _ = flatten_patches(video[:1], spec)  # an image: its frame repeated to the temporal patch
    assert torch.equal(single.view(-1, 3, 2, 16)[:, :, 0], single.view(-1, 3, 2, 16)[:, :, 1])


def test_smart_resize_refuses_extreme_aspect_ratios():
    assert smart_resize(28, 28 * 200, 28, 56 * 56, 28 * 28 * 1280)
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 2001, 28, 56 * 56, 28 * 28 * 1280)
