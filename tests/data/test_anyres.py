"""AnyRes tiling against transformers' LlavaNextImageProcessor (PIL backend): pixel tiles and image_sizes for many
aspect ratios, CLIP and SigLIP statistics; the pinpoint forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from neva.data.anyres import tile_image
from neva.models.anyres import AnyResConfig, grid_shape, parse_grid_pinpoints, select_best_resolution
from neva.models.config import VisionConfig
from neva.models.vision import normalize_pixels

SIZE = 16
PINPOINTS = [[16, 32], [32, 16], [32, 32], [48, 16], [16, 48]]
# (width, height): square, wide, tall, extreme, tiny, odd sizes that exercise the ceil and the odd padding.
SIZES = [(16, 16), (40, 20), (20, 40), (90, 13), (13, 90), (5, 3), (3, 5), (33, 31), (47, 29), (100, 100), (7, 61)]


def hf_processor(vision: VisionConfig):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(
        size={"shortest_edge": SIZE},
        crop_size={"height": SIZE, "width": SIZE},
        image_grid_pinpoints=PINPOINTS,
        image_mean=list(vision.image_mean),
        image_std=list(vision.image_std),
    )


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_tiles_and_image_sizes_match_llava_next_processor(kind):
    act = {"clip": "quick_gelu", "siglip": "gelu_pytorch_tanh"}[kind]
    vision = VisionConfig(kind=kind, image_size=SIZE, patch_size=4, hidden_act=act)
    ref = hf_processor(vision)
    cfg = AnyResConfig(grid_pinpoints=PINPOINTS)
    rng = np.random.default_rng(0)
    grids = set()
    for w, h in SIZES:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        out = ref(img, return_tensors="np")
        theirs = torch.from_numpy(np.asarray(out["pixel_values"][0]))
        ours = tile_image(img, cfg, SIZE)
        assert ours.dtype == torch.uint8
        assert ours.shape == theirs.shape, (w, h)
        norm = normalize_pixels(ours, vision.image_mean, vision.image_std)
        torch.testing.assert_close(norm, theirs, rtol=0, atol=1e-6, msg=f"{w}x{h}")
        assert tuple(out["image_sizes"][0]) == (h, w)
        rows, cols = grid_shape((h, w), cfg.grid_pinpoints, SIZE)
        assert ours.shape[0] == 1 + rows * cols
        grids.add((rows, cols))
    assert len(grids) >= 4  # the sizes above reach most pinpoints


def test_best_resolution_matches_transformers():
    from transformers.image_processing_utils import select_best_resolution as hf_select

    pins = parse_grid_pinpoints("(1x1),...,(3x3)", 7)
    for h in range(1, 60, 4):
        for w in range(1, 60, 5):
            assert select_best_resolution((h, w), pins) == tuple(hf_select((h, w), pins))


def test_pinpoint_range_form_is_llava_next():
    assert parse_grid_pinpoints("(1x1),...,(2x3)", 10) == [[10, 10], [10, 20], [10, 30], [20, 10], [20, 20], [20, 30]]
    assert parse_grid_pinpoints([[336, 672], (672, 336)], 336) == [[336, 672], [672, 336]]
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        parse_grid_pinpoints("1x1..3x3", 10)
    with pytest.raises(ValueError, match="multiples"):
        AnyResConfig(grid_pinpoints=[[20, 30]]).check_tile(16)
    with pytest.raises(ValueError, match="anyres_max"):
        AnyResConfig(max_tiles=9)
