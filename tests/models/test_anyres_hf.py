"""AnyRes model side against transformers' LlavaNextForConditionalGeneration (tiny random, fp32): per-image token
counts, logits of a batch mixing grids, the feature layouts against LLaVA-NeXT's ``flat`` / ``spatial``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from neva.data.anyres import tile_image
from neva.models.anyres import AnyResConfig, batch_feature_index, feature_index, grid_shape
from neva.models.media import image_media
from tests.hf_oracle import VISION_KW, neva_from_hf, tiny_llava_next

S = VISION_KW["image_size"]  # 28 px tiles, 4x4 patches
PINPOINTS = [[S, 2 * S], [2 * S, S], [2 * S, 2 * S], [3 * S, S], [S, 3 * S]]
# (width, height) of images that land on different grids and unpad rows or columns
SIZES = [(60, 30), (30, 75), (41, 43), (100, 20), (9, 7)]


def images(sizes=SIZES):
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def prompt_ids(counts: list[list[int]], image_id: int, text: int = 3) -> torch.Tensor:
    """One row per sample: ``text`` ids, then each image's positions and ``text`` ids; right-padded with id 1."""
    rows = []
    for per_row in counts:
        row = list(range(2, 2 + text))
        for n in per_row:
            row += [image_id] * n + list(range(5, 5 + text))
        rows.append(row)
    width = max(map(len, rows))
    return torch.tensor([r + [1] * (width - len(r)) for r in rows])


def test_token_counts_and_logits_match_llava_next():
    hf = tiny_llava_next()
    ours = neva_from_hf(hf)
    cfg = ours.cfg
    assert cfg.anyres is not None and cfg.anyres.patch_merge_type == "spatial_unpad"
    imgs = images()
    sizes = [(im.size[1], im.size[0]) for im in imgs]
    index = (lay := batch_feature_index(cfg.anyres, cfg.num_image_tokens, S, sizes))[0].index
    counts = lay[1]
    # HF's own packing gives the same per-image lengths (the one count rule)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    proc = LlavaNextImageProcessorPil(
        size={"shortest_edge": S}, crop_size={"height": S, "width": S}, image_grid_pinpoints=PINPOINTS
    )
    batch = proc(imgs, return_tensors="pt")
    with torch.no_grad():
        feats = hf.model.get_image_features(batch["pixel_values"], batch["image_sizes"]).pooler_output
    assert [f.shape[0] for f in feats] == counts == [cfg.image_tokens(s) for s in sizes]
    assert len({grid_shape(s, PINPOINTS, S) for s in sizes}) >= 4

    # rows: two images; one image; text only; two images
    per_row = [[counts[0], counts[1]], [counts[2]], [], [counts[3], counts[4]]]
    ids = prompt_ids(per_row, cfg.image_token_id)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"]).logits
    # neva: every tile of the batch in one tower call; uint8 tiles from neva's own tiling, normalised in the tower
    tiles = torch.cat([tile_image(im, cfg.anyres, S) for im in imgs])
    image_counts = torch.tensor([len(r) for r in per_row])
    with torch.no_grad():
        got_sync_free = ours(
            ids, image_media(tiles, image_counts, positions=(ids == cfg.image_token_id).nonzero(), index=index)
        )
        h = ours.embed(ids, image_media(tiles, image_counts, index=index, tokens=torch.tensor(counts)))
        got_checked = ours.llm(h)
    for got in (got_sync_free, got_checked):
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel <= 1e-5, rel
    with pytest.raises(ValueError, match=r"sample\(s\) \[1\]"):
        ours.embed(
            ids,
            image_media(
                tiles, torch.tensor([2, 1, 0, 2]), index=index, tokens=torch.tensor([*counts[:2], 5, *counts[3:]])
            ),
        )


def _llava_next_layout(feats: torch.Tensor, grid: tuple[int, int], merge: str) -> torch.Tensor:
    """LLaVA-NeXT's ``prepare_inputs_labels_for_multimodal`` for ``flat`` and ``spatial`` (rewritten here)."""
    if merge == "flat":
        return feats.flatten(0, 1)
    base, tiles = feats[0], feats[1:]
    side = int(base.shape[0] ** 0.5)
    rows, cols = grid
    tiles = tiles.view(rows, cols, side, side, -1).permute(0, 2, 1, 3, 4).flatten(0, 3)
    return torch.cat([base, tiles])


@pytest.mark.parametrize("merge", ["flat", "spatial"])
def test_flat_and_spatial_layouts_are_llava_next(merge):
    cfg = AnyResConfig(grid_pinpoints=PINPOINTS, patch_merge_type=merge)
    for w, h in SIZES:
        index, tiles, _ = feature_index(cfg, 16, S, (h, w))
        feats = torch.randn(tiles, 16, 5)
        torch.testing.assert_close(
            feats.flatten(0, 1)[index], _llava_next_layout(feats, grid_shape((h, w), PINPOINTS, S), merge)
        )
    # a fixed-size (single-tile) image: its features, plus the newline only in the unpad layout
    assert feature_index(cfg, 16, S, None)[0].tolist() == list(range(16))
    unpad = AnyResConfig(grid_pinpoints=PINPOINTS)
    assert feature_index(unpad, 16, S, None)[0].tolist() == [*range(16), -1]
