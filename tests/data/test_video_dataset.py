"""Video records through the dataset, the collator and the data module: positions per ``NevaConfig.video_tokens``,
frames as the tower's image fit, mixed with image and text-only records (padded, packed, joined), bad videos counted
skips."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from neva.data.collate import collate_packed, collate_padded
from neva.data.config import DataConfig
from neva.data.datamodule import NevaDataModule
from neva.data.dataset import ConversationDataset, EncoderSettings, is_skipped
from neva.data.front_ends import FixedImages
from neva.data.images import ImageProcessor, image_source_for
from neva.data.make_shards import main as make_shards_main
from neva.data.shards import ShardDataset
from neva.data.templates.registry import get_template
from neva.data.video import VideoSource
from neva.data.video_decode import VideoLimits
from neva.models.presets import build_config
from neva.models.video import VideoConfig
from tests.data.conftest import qa, write_image, write_jsonl
from tests.data.video_files import reference_decode, write_video

IMAGE_ID = 4
NUM_FRAMES = 4
LIMITS = VideoLimits(NUM_FRAMES)


def conv(q, a="left"):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    write_video(d / "clip.mp4", 20)
    write_video(d / "short.mp4", 3)
    write_image(d / "a.png")
    return d


@pytest.fixture(scope="module")
def cfg(synthetic_tokenizer):
    # a video token id of its own (transformers' video_token_index), beyond the tokenizer's ids
    return dataclasses.replace(
        build_config(image_token_id=IMAGE_ID), video=VideoConfig(), video_token_id=len(synthetic_tokenizer)
    )


def dataset(records, tokenizer, cfg, folder, limits=LIMITS, max_length=512, video=True):
    settings = EncoderSettings(
        tokenizer, get_template("vicuna_v1"), IMAGE_ID, cfg.num_image_tokens, max_length,
        video_tokens=cfg.video_tokens if video else None, video_token_id=cfg.video_token_id, num_frames=NUM_FRAMES,
    )  # fmt: skip
    return ConversationDataset(
        records, settings, image_source_for(str(folder)), FixedImages(ImageProcessor(cfg.vision)),
        VideoSource(str(folder), limits, cfg.vision),
    )  # fmt: skip


MIXED = [
    {"id": "nemo", "video": "clip.mp4", "conversations": conv("<video>\nWhich way?")},
    qa(image="a.png", rid="image"),
    qa(image=None, q="What is 2 plus 3?", a="5", rid="text"),
    {"id": "llava_video", "video": ["clip.mp4"], "conversations": conv("<image>\nWhich way?")},  # LLaVA-Video-178K
    {"id": "no_tag", "video": "short.mp4", "conversations": conv("Which way?")},
    {"id": "both", "image": "a.png", "video": "clip.mp4", "conversations": conv("<image> then <video> Same?", "no")},
]


def test_video_samples_take_the_models_positions_and_the_towers_frames(synthetic_tokenizer, cfg, folder):
    ds = dataset(MIXED, synthetic_tokenizer, cfg, folder)
    samples = {r["id"]: ds[i] for i, r in enumerate(MIXED)}
    per_video = cfg.video_tokens(NUM_FRAMES)
    for rid in ("nemo", "llava_video", "no_tag", "both"):
        s = samples[rid]
        assert s["video_frames"].tolist() == [NUM_FRAMES]  # uniform sampling: a short video repeats frames
        assert s["video_positions"].numel() == per_video
        assert torch.equal(s["video_positions"], (s["input_ids"] == cfg.video_token_id).nonzero().flatten())
        assert s["video_positions"].diff().eq(1).all()  # one contiguous span per video
        assert s["video_pixel_values"].shape == (NUM_FRAMES, 3, cfg.vision.image_size, cfg.vision.image_size)
    for rid in ("image", "both"):
        assert samples[rid]["image_positions"].numel() == cfg.num_image_tokens
        assert (samples[rid]["input_ids"][samples[rid]["image_positions"]] == IMAGE_ID).all()
    assert samples["both"]["image_positions"].max() < samples["both"]["video_positions"].min()  # text order
    assert "video_positions" not in samples["text"] and "video_positions" not in samples["image"]
    # frames: PyAV's plain loop at the linspace indices, then the tower's image fit (FITS), nothing else
    fit = ImageProcessor(cfg.vision, "square")
    want = [fit(Image.fromarray(a)) for a in reference_decode(folder / "clip.mp4", [0, 6, 12, 19])]
    assert torch.equal(samples["nemo"]["video_pixel_values"], torch.stack(want))
    lengths = ds.modality_lengths()
    assert lengths[0] > per_video and lengths[2] < 0  # video records count as multimodal, with their positions


def test_fps_sampling_gives_the_frames_a_short_video_has(synthetic_tokenizer, cfg, folder):
    record = {"id": "fps", "video": "short.mp4", "conversations": conv("<video>\nWhich way?")}
    s = dataset([record], synthetic_tokenizer, cfg, folder, VideoLimits(NUM_FRAMES, fps=10.0))[0]
    assert s["video_frames"].tolist() == [3]
    assert s["video_positions"].numel() == cfg.video_tokens(3)


@pytest.mark.parametrize("mode", ["padded", "packed", "joined"])
def test_batches_keep_video_positions_frames_and_order(synthetic_tokenizer, cfg, folder, mode):
    ds = dataset(MIXED, synthetic_tokenizer, cfg, folder)
    samples = [ds[i] for i in range(len(ds))]
    if mode == "padded":
        batch = collate_padded(samples, 0, 8, 512)
    else:
        batch = collate_packed(samples, 0, 512, 8)
        assert batch.input_ids.shape[0] < len(samples)  # samples share rows
        batch = batch.joined() if mode == "joined" else batch
    vid = cfg.video_token_id
    video, image = batch.media.video, batch.media.image
    assert torch.equal(video.positions, (batch.input_ids == vid).nonzero())  # row, then column order
    by_id = {s["id"]: s for s in samples}
    order = [i for i in batch.counts.ids if "video_frames" in by_id[i]]
    assert video.frames.tolist() == [f for i in order for f in by_id[i]["video_frames"].tolist()]
    assert torch.equal(video.pixels, torch.cat([by_id[i]["video_pixel_values"] for i in order]))
    assert video.positions.shape[0] == sum(cfg.video_tokens(int(f)) for f in video.frames)
    rows, cols = image.positions.unbind(1)
    assert (batch.input_ids[rows, cols] == IMAGE_ID).all()
    assert image.positions.shape[0] == 2 * cfg.num_image_tokens


def test_batches_without_video_have_none(synthetic_tokenizer, cfg, folder):
    ds = dataset(MIXED[1:3], synthetic_tokenizer, cfg, folder)
    batch = collate_padded([ds[0], ds[1]], 0)
    assert batch.media.video is None


@pytest.fixture
def bad_folder(tmp_path, folder):
    d = tmp_path / "videos"
    d.mkdir()
    shutil.copy(folder / "clip.mp4", d / "clip.mp4")
    write_video(tmp_path / "outside.mp4", 4)
    os.symlink(tmp_path / "outside.mp4", d / "link.mp4")
    (d / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 40)
    Image.new("RGB", (16, 16)).save(d / "still.mp4", format="PNG")
    os.mkfifo(d / "pipe.mp4")  # a blocking open would hang the worker
    return d


BAD = {
    "unsafe_video_path": {"id": "escape", "video": "../outside.mp4", "conversations": conv("<video>\nQ")},
    "missing_video": {"id": "missing", "video": "nope.mp4", "conversations": conv("<video>\nQ")},
    "not_regular_file": {"id": "pipe", "video": "pipe.mp4", "conversations": conv("<video>\nQ")},
    "corrupt_video": {"id": "corrupt", "video": "corrupt.mp4", "conversations": conv("<video>\nQ")},
    "still_image": {"id": "still", "video": "still.mp4", "conversations": conv("<video>\nQ")},
    "video_count_mismatch": {"id": "count", "video": "clip.mp4", "conversations": conv("<video><video>\nQ")},
    "video_count_mismatch ": {"id": "no_video", "conversations": conv("<video>\nQ")},  # a placeholder, no video
    "video_in_reply": {"id": "reply", "video": "clip.mp4", "conversations": conv("<video>\nQ", "here <video>")},
    # the video (in the second turn) would be cut: skipped, never truncated inside a video
    "too_long": {"id": "long", "video": "clip.mp4", "conversations": conv("word " * 100, "a") + conv("<video>\nQ")},
}


def test_bad_videos_are_counted_skips_and_the_rest_continues(synthetic_tokenizer, cfg, bad_folder):
    records = [
        *BAD.values(),
        {"id": "absolute", "video": "/etc/x.mp4", "conversations": conv("<video>\nQ")},
        {"id": "symlink", "video": "link.mp4", "conversations": conv("<video>\nQ")},
        {"id": "good", "video": "clip.mp4", "conversations": conv("<video>\nQ")},
    ]
    ds = dataset(records, synthetic_tokenizer, cfg, bad_folder, max_length=160)
    samples = [ds[i] for i in range(len(ds))]
    reasons = {s["id"]: s.get("skipped") for s in samples}
    for reason, record in BAD.items():
        assert reasons[record["id"]] == reason.strip(), record["id"]
    assert reasons["absolute"] == reasons["symlink"] == "unsafe_video_path"
    assert reasons["good"] is None
    batch = collate_padded(samples, 0)
    assert batch.counts.num_samples == 1 and sum(batch.counts.skipped.values()) == len(records) - 1
    assert batch.media.video.frames.tolist() == [NUM_FRAMES]
    # a model without video skips video records (and keeps the rest)
    text = qa(image=None, q="Q?", rid="t")
    plain = dataset([records[-1], text], synthetic_tokenizer, cfg, bad_folder, video=False)
    assert plain[0]["skipped"] == "video_unsupported" and not is_skipped(plain[1])
    # the byte cap is read from the file size, before anything is decoded
    small = dataset(records[-1:], synthetic_tokenizer, cfg, bad_folder, VideoLimits(NUM_FRAMES, max_bytes=100))
    assert small[0]["skipped"] == "video_too_large"


def test_data_module_mixes_video_image_and_text(tmp_path, synthetic_tokenizer, cfg, folder):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, MIXED * 2)
    data = DataConfig(data_path=str(path), image_folder=str(folder), num_frames=NUM_FRAMES, media_type="video")
    dm = NevaDataModule(data, synthetic_tokenizer, cfg, micro_batch_size=len(MIXED), seed=0)
    batches = list(dm.train_dataloader())
    assert sum(b.counts.num_samples for b in batches) == 2 * len(MIXED)
    frames = sum(int(b.media.video.frames.sum()) for b in batches if b.media.video is not None)
    assert frames == 2 * 4 * NUM_FRAMES
    with pytest.raises(ValueError, match="media_type=video needs a model that takes video"):
        NevaDataModule(data, synthetic_tokenizer, build_config(image_token_id=IMAGE_ID))
    with pytest.raises(ValueError, match="num_frames must be > 0"):
        DataConfig(data_path=str(path), num_frames=0)
    assert np.isfinite(data.video_limits.max_seconds)


def test_shards_carry_videos_as_the_json_file_does(tmp_path, synthetic_tokenizer, cfg, folder):
    """make_shards packs the mp4 bytes; the shard reader decodes them with the folder's decoder: equal samples, the
    same skips (an escaping path, a missing file, a corrupt member, an mp4 that is a still image), one blend."""
    media = tmp_path / "media"
    shutil.copytree(folder, media)
    (media / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 40)
    Image.new("RGB", (16, 16)).save(media / "still.mp4", format="PNG")
    bad = [BAD[r] for r in ("unsafe_video_path", "missing_video", "corrupt_video", "still_image")]
    records = [*MIXED, {"id": "list", "video": ["short.mp4", "clip.mp4"], "conversations": conv("<video><video>")}]
    path = tmp_path / "data.jsonl"
    write_jsonl(path, records + bad)
    out = tmp_path / "shards" / "mix"
    assert make_shards_main(["--data-path", str(path), "--image-folder", str(media), "--out", str(out),
                             "--samples-per-shard", "6"]) == 0  # fmt: skip
    pattern = f"{out}-{{000000..000001}}.tar"
    ref = dataset(records + bad, synthetic_tokenizer, cfg, media)
    shards = ShardDataset.from_spec(pattern, ref.settings, ref.front_end, video_source=ref.video_source)
    assert len(shards) == len(ref) == 11
    for i in range(len(ref)):
        a, b = ref[i], shards[i]
        assert a.keys() == b.keys() and a["id"] == b["id"] and a.get("skipped") == b.get("skipped"), a["id"]
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b[k]), (a["id"], k)
    assert [shards[i].get("skipped") for i in range(7, 11)] == ["unsafe_video_path", "missing_video",
                                                                 "corrupt_video", "still_image"]  # fmt: skip
    assert shards[6]["video_frames"].tolist() == [NUM_FRAMES, NUM_FRAMES]
    # a blend of the shards (videos, images, text, bad videos) and the JSON file: every video decoded, skips counted
    data = DataConfig(data_path=[pattern, str(path)], concat_sampling_probabilities=[0.5, 0.5], num_frames=NUM_FRAMES,
                      image_folder=str(media), media_type="video", max_skip_fraction=1.0)  # fmt: skip
    dm = NevaDataModule(data, synthetic_tokenizer, cfg, micro_batch_size=len(ref), seed=0)
    batches = list(dm.train_dataloader())
    drawn = sum(b.counts.num_samples for b in batches) + sum(sum(b.counts.skipped.values()) for b in batches)
    assert drawn == 2 * len(ref) and dm.skip_tracker.used == 2 * 7
    assert dm.skip_tracker.skipped == {r: 2 for r in ("unsafe_video_path", "missing_video", "corrupt_video",
                                                      "still_image")}  # fmt: skip
    assert sum(int(b.media.video.frames.sum()) for b in batches) == 2 * 6 * NUM_FRAMES


def test_preview_shows_frames_positions_and_skips(tmp_path, folder):
    import io
    import json

    from neva.data.preview import build_parser, preview

    path = tmp_path / "data.jsonl"
    bad = {"id": "bad", "video": "../x.mp4", "conversations": conv("<video>\nQ")}
    write_jsonl(path, [MIXED[0], MIXED[4], bad])
    common = ["--data-path", str(path), "--conv-template", "vicuna_v1", "--tokenizer", "synthetic", "--num-frames", "4"]
    out = io.StringIO()
    args = build_parser().parse_args([*common, "--json", "--video-folder", str(folder), "--video-grid", "4"])
    assert preview(args, out) == 1
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    (video,) = rows[0]["videos"]
    assert video["frames"] == 4 and video["indices"] == [0, 6, 12, 19] and video["total"] == 20
    assert video["tokens"] == 4 * (4 // 2) ** 2  # 2x2 pooling of a 4x4 grid, per frame
    assert rows[1]["videos"][0]["indices"] == [0, 0, 1, 2]  # 3 frames: linspace repeats
    assert rows[2] == {
        "id": "bad",
        "skipped": "unsafe_video_path",
        "detail": "video path '../x.mp4' escapes the video folder",
    }
    text = io.StringIO()
    preview(build_parser().parse_args([*common, "--no-color"]), text)  # no folder: uniform frames, nothing decoded
    assert "clip.mp4: 4 frames (uniform; not decoded), 576 positions" in text.getvalue()
