"""Per-sample visual budgets (``model.data.max_visual_tokens``, ``neva.data.visual_budget``): a record past the
budget keeps fewer frames, is downscaled or is skipped as configured, counted per action and named in the preview;
records within it are the samples they are without a budget."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch

from neva.data.collate import collate_padded
from neva.data.dataset import ConversationDataset, EncoderSettings, is_skipped
from neva.data.front_ends import FixedImages, NativeImages
from neva.data.images import ImageProcessor, image_source_for
from neva.data.preview import build_parser, preview
from neva.data.qwen_images import image_token_count
from neva.data.skips import SkipTracker
from neva.data.templates.registry import get_template
from neva.data.video import VideoSource
from neva.data.video_decode import VideoLimits
from neva.data.visual_budget import VisualBudget
from neva.models.presets import build_config
from neva.models.video import VideoConfig
from tests.data.conftest import qa, write_image
from tests.data.video_files import write_video

IMAGE_ID, FRAMES = 4, 4


def conv(q, a="left"):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


RECORDS = [
    {"id": "both", "image": "a.png", "video": "clip.mp4", "conversations": conv("<image> then <video> Same?", "no")},
    qa(image="a.png", rid="image"),
    qa(image=None, q="What is 2 plus 3?", a="5", rid="text"),
    {"id": "four", "image": ["a.png"] * 4, "conversations": conv("<image>" * 4 + "\nHow many?", "4")},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    write_video(d / "clip.mp4", 20)
    write_image(d / "a.png")
    write_image(d / "big.png", size=(256, 128))
    return d


def fixed_dataset(tokenizer, folder, budget):
    cfg = dataclasses.replace(build_config(image_token_id=IMAGE_ID), video=VideoConfig(), video_token_id=len(tokenizer))
    settings = EncoderSettings(
        tokenizer, get_template("vicuna_v1"), IMAGE_ID, cfg.num_image_tokens, 512, video_tokens=cfg.video_tokens,
        video_token_id=cfg.video_token_id, num_frames=FRAMES, visual_budget=budget,
    )  # fmt: skip
    front = FixedImages(ImageProcessor(cfg.vision))
    video = VideoSource(str(folder), VideoLimits(FRAMES), cfg.vision)
    return ConversationDataset(RECORDS, settings, image_source_for(str(folder)), front, video), cfg


def test_fewer_frames_and_skip_on_a_fixed_tower(synthetic_tokenizer, folder):
    plain, cfg = fixed_dataset(synthetic_tokenizer, folder, None)
    per_image = cfg.num_image_tokens
    limit = per_image + cfg.video_tokens(2)  # the image and two of the video's four frames
    for action in ("fewer_frames", "skip"):
        ds, _ = fixed_dataset(synthetic_tokenizer, folder, VisualBudget(limit, action))
        samples = [ds[i] for i in range(len(RECORDS))]
        both, image, text, four = samples
        for got, want in ((image, plain[1]), (text, plain[2])):  # within the budget: unchanged
            for key in ("input_ids", "labels", "pixel_values"):
                assert torch.equal(got[key], want[key]), key
        assert is_skipped(four) and four["skipped"] == "visual_budget"  # its images alone are over
        if action == "skip":
            assert is_skipped(both) and both["skipped"] == "visual_budget"
            continue
        full = plain[0]
        assert both["visual_budget"] == "fewer_frames" and both["video_frames"].tolist() == [2]
        assert per_image + len(both["video_positions"]) == limit
        # the first and last of the four sampled frames, as the tower sees them
        side = full["video_pixel_values"].shape[0] // FRAMES
        assert side == 1 and torch.equal(both["video_pixel_values"], full["video_pixel_values"][[0, 3]])
        batch = collate_padded([s for s in samples], 0, 8, 512)
        assert batch.counts.visual_budget == {"fewer_frames": 1} and batch.counts.skipped == {"visual_budget": 1}
        tracker = SkipTracker(1.0)
        tracker.update(batch.counts)
        metrics = tracker.metrics()
        assert metrics["data/visual_budget/fewer_frames"] == 1 and metrics["data/skipped/visual_budget"] == 1
        state = tracker.state_dict()
        resumed = SkipTracker(1.0)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # plain data: resumes its counts
        assert resumed.metrics() == metrics


def test_downscale_on_a_native_tower(synthetic_tokenizer, folder):
    cfg = build_config("tiny", "tiny_qwen2_5_vl", projector_type="qwen2_5_vl_merger", image_token_id=IMAGE_ID)
    low, high = 16 * 16 * 4, 16 * 16 * 256
    records = [qa(image="big.png", rid="big"), qa(image="a.png", rid="small")]

    def dataset(budget):
        settings = EncoderSettings(synthetic_tokenizer, get_template("vicuna_v1"), IMAGE_ID, 0, 2048,
                                   visual_budget=budget)  # fmt: skip
        return ConversationDataset(records, settings, image_source_for(str(folder)), NativeImages(cfg, low, high))

    spec = NativeImages(cfg, low, high).processor
    full = image_token_count(spec, 128, 256)  # the large image at the tower's pixel budget
    small = image_token_count(spec, 30, 40)
    limit = full // 3
    assert small <= limit < full
    plain, budget = dataset(None), dataset(VisualBudget(limit, "downscale"))
    big = budget[0]
    tokens = int(big["image_grid"].prod()) // spec.merge_size**2
    assert big["visual_budget"] == "downscale" and tokens <= limit
    assert tokens > limit // 2  # downscaled to about the budget, not to the smallest size
    assert int((big["input_ids"] == IMAGE_ID).sum()) == tokens
    for key in ("input_ids", "pixel_values", "image_grid"):  # the small image is within it: unchanged
        assert torch.equal(budget[1][key], plain[1][key]), key
    assert dataset(VisualBudget(1, "downscale"))[0]["skipped"] == "visual_budget"  # not even at min_pixels


def test_preview_names_the_outcome(synthetic_tokenizer, folder, tmp_path):
    data = tmp_path / "data.json"
    data.write_text(json.dumps(RECORDS))
    # 16 positions an image, 4 a frame (a 4 x 4 grid pooled 2 x 2)
    base = ["--data-path", str(data), "--image-folder", str(folder), "--conv-template", "vicuna_v1",
            "--tokenizer", "synthetic", "--num-image-tokens", "16", "--video-grid", "4", "--num-frames", "4",
            "--visual-budget-action", "fewer_frames"]  # fmt: skip
    out = io.StringIO()
    skipped = preview(build_parser().parse_args([*base, "--json", "--max-visual-tokens", "24"]), out)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert skipped == 1 and rows[3]["skipped"] == "visual_budget"
    assert rows[0]["visual_budget"] == "fewer_frames" and rows[0]["videos"][0]["frames"] == 2
    assert rows[0]["videos"][0]["indices"] == [0, 19]  # the first and last of the four sampled frames
    assert "visual_budget" not in rows[1]
    out = io.StringIO()
    preview(build_parser().parse_args([*base, "--max-visual-tokens", "20"]), out)
    text = out.getvalue()
    assert "over model.data.max_visual_tokens=20: fewer_frames" in text and "1 frames (of 4: visual budget)" in text


def test_downscale_on_anyres(synthetic_tokenizer, folder):
    """AnyRes: the record's image resized (0.9ⁿ a side) until its tiles fit; its positions then are the resized
    image's own (``NevaConfig.image_tokens`` of the new size), and its pixels that image's tiles."""
    from PIL import Image

    from neva.data.anyres import AnyResProcessor
    from neva.data.front_ends import TiledImages
    from neva.data.visual_budget import ANYRES_FACTORS
    from neva.models.anyres import AnyResConfig, parse_grid_pinpoints

    base = build_config(image_token_id=IMAGE_ID)
    cfg = dataclasses.replace(base, anyres=AnyResConfig(grid_pinpoints=parse_grid_pinpoints("(1x1),...,(2x3)", 32)))
    records = [qa(image="big.png", rid="big"), qa(image="a.png", rid="small")]

    def dataset(budget):
        settings = EncoderSettings(synthetic_tokenizer, get_template("vicuna_v1"), IMAGE_ID, cfg.num_image_tokens,
                                   2048, visual_budget=budget)  # fmt: skip
        return ConversationDataset(records, settings, image_source_for(str(folder)), TiledImages(AnyResProcessor(cfg)))

    full = cfg.image_tokens((128, 256))
    limit = full - 1
    plain, budget = dataset(None), dataset(VisualBudget(limit, "downscale"))
    big = budget[0]
    tokens = int((big["input_ids"] == IMAGE_ID).sum())
    assert big["visual_budget"] == "downscale" and tokens <= limit
    # the first factor whose image fits, computed from the sizes directly
    factor = next(f for f in ANYRES_FACTORS if cfg.image_tokens((round(128 * f), round(256 * f))) <= limit)
    resized = Image.open(folder / "big.png").convert("RGB")
    resized = resized.resize((round(256 * factor), round(128 * factor)), Image.BICUBIC)
    assert tokens == cfg.image_tokens((resized.size[1], resized.size[0]))
    assert torch.equal(big["pixel_values"], AnyResProcessor(cfg).tiles([resized]))
    for key in ("input_ids", "pixel_values"):  # the small image is within it: unchanged
        assert torch.equal(budget[1][key], plain[1][key]), key
