"""AnyRes tiling against transformers' LlavaNextImageProcessor (PIL backend): pixel tiles and image_sizes for many
aspect ratios, CLIP and SigLIP statistics; the pinpoint forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from neva.data.anyres import tile_image
from neva.data.front_ends import TiledImages
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
    from neva.data.config import DataConfig

    assert DataConfig(image_aspect_ratio="anyres_max_9").image_aspect_ratio == "anyres_max_9"  # LLaVA-OneVision
    with pytest.raises(ValueError, match="anyres_max_x"):
        DataConfig(image_aspect_ratio="anyres_max_x")
    with pytest.raises(ValueError, match="spatial_unpad"):
        AnyResConfig(patch_merge_type="spatial", max_num_patches=9)


def _record(i: int, images: list[str]) -> dict:
    tags = "".join("<image>\n" for _ in images)
    rec = {"id": i, "conversations": [{"from": "human", "value": tags + "how many"}, {"from": "gpt", "value": "two"}]}
    if images:
        rec["images" if len(images) > 1 else "image"] = images if len(images) > 1 else images[0]
    return rec


@pytest.mark.parametrize(
    "vision,projector", [("tiny", "mlp2x_gelu"), ("tiny_siglip", "mlp_downsample")], ids=["clip", "siglip_downsample"]
)
def test_dataset_packs_mixed_anyres_samples_equal_to_each_alone(synthetic_tokenizer, vision, projector):
    """AnyRes samples of different grids, two images, text only: real lengths before the tower, one packed batch
    whose forward equals each sample's own forward (tiles of the micro-batch in one tower call); mlp_downsample
    merges 2x2 patches per tile (a 2x2 feature grid per tile of SigLIP's 4x4)."""
    import dataclasses

    from neva.data.anyres import AnyResProcessor
    from neva.data.collate import Collator
    from neva.data.dataset import ConversationDataset, EncoderSettings
    from neva.data.images import CallableImageSource
    from neva.data.templates.registry import get_template
    from neva.models.neva import NevaModel
    from neva.models.presets import build_config

    image_id = synthetic_tokenizer.convert_tokens_to_ids("<image>")
    base = build_config(vision=vision, projector_type=projector, image_token_id=image_id)
    pins = parse_grid_pinpoints("(1x1),...,(2x3)", base.vision.image_size)
    cfg = dataclasses.replace(base, anyres=AnyResConfig(grid_pinpoints=pins))
    rng = np.random.default_rng(3)
    shapes = {"wide.png": (90, 30), "tall.png": (30, 70), "square.png": (32, 32), "tiny.png": (5, 9)}
    pics = {k: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for k, (w, h) in shapes.items()}
    records = [
        _record(0, ["wide.png"]),
        _record(1, []),
        _record(2, ["tall.png", "tiny.png"]),
        _record(3, ["square.png"]),
    ]
    settings = EncoderSettings(
        tokenizer=synthetic_tokenizer,
        template=get_template("vicuna_v1", synthetic_tokenizer),
        image_token_id=image_id,
        num_image_tokens=cfg.num_image_tokens,
        max_length=1024,
    )
    ds = ConversationDataset(
        records, settings, CallableImageSource(pics.__getitem__), TiledImages(AnyResProcessor(cfg))
    )
    samples = [ds[i] for i in range(len(ds))]
    for rec, s in zip(records, samples):
        names = [rec["image"]] if "image" in rec else rec.get("images", [])
        expected = sum(cfg.image_tokens((pics[n].size[1], pics[n].size[0])) for n in names)
        assert (
            int((s["input_ids"] == image_id).sum()) == expected == s.get("image_feature_index", torch.zeros(0)).numel()
        )
    assert len({int((s["input_ids"] == image_id).sum()) for s in samples}) == 4  # real lengths differ
    # length grouping counts the same real positions, from the images' sizes (no decode for files)
    from neva.data.records import approx_length

    real = [int((s["input_ids"] == image_id).sum()) for s in samples]
    words = [approx_length(r, 0) for r in records]
    assert ds.modality_lengths() == [w + n if n else w for w, n in zip(words, real)]

    torch.manual_seed(0)
    model = NevaModel(cfg).eval()
    model.init_weights()
    packed = Collator(0, 1024, 8, packing=True)(samples)
    assert packed.input_ids.shape[0] == 1 and packed.media.image.items_per_row.tolist() == [4]
    with torch.no_grad():
        got = model(
            packed.input_ids,
            packed.media,
            position_ids=packed.position_ids,
            segment_ids=packed.segment_ids,
        )[0]
        start = 0
        for s in samples:
            alone = Collator(0, 1024, 1)([s])
            ref = model(alone.input_ids, alone.media)[0]
            n = s["input_ids"].numel()
            torch.testing.assert_close(got[start : start + n], ref[:n], rtol=1e-5, atol=1e-5)
            start += n


def test_folder_image_size_reads_the_header(tmp_path):
    from neva.data.images import FolderImageSource, ImageError

    Image.new("RGB", (70, 20)).save(tmp_path / "a.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    source = FolderImageSource(str(tmp_path))
    assert source.size("a.png") == (20, 70)
    for name, reason in (("bad.png", "corrupt_image"), ("none.png", "missing_image")):
        with pytest.raises(ImageError) as err:
            source.size(name)
        assert err.value.reason == reason
