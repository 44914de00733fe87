"""Qwen2-VL / Qwen2.5-VL video against transformers' own classes (tiny random hub directories, a real mp4 written in
the test): a record's video through neva's decoding → native front end → collate gives the ids, temporal patches,
grid and (Qwen2.5-VL) ``second_per_grid_ts`` timing of HF's processors, whole-model logits equal HF's, and a packed
row of a video, a video-and-image and an image sample equals each sample alone.

transformers' Qwen2-VL video processor needs torchvision (not installed): the reference patches are its ``patchify``
layout transcribed below, over the frames PyAV's plain decode loop gives at the sampled indices."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from neva.checkpoint.hf_qwen_vl import import_qwen_vl
from neva.checkpoint.neva_format import load_config, load_metadata
from neva.data.collate import collate_packed, collate_padded
from neva.data.conversation import parse_conversations
from neva.data.dataset import process_record
from neva.data.front_ends import front_end_for
from neva.data.images import FolderImageSource
from neva.data.qwen_images import QwenImageSpec, native_video_estimate
from neva.data.video import VideoSource
from neva.data.video_decode import VideoLimits
from tests.checkpoint.tiny_hf import one_thread
from tests.data.video_files import reference_decode, write_video
from tests.fixtures.data_path import checkpoint_data_path
from tests.fixtures.tiny_qwen_vl import (
    MERGE,
    image_processor,
    pixel_budget,
    tiny_qwen_vl_dir,
    write_image,
)
from tests.models.test_hf_parity import rel_err

FRAMES, NUM_FRAMES, SIDE, RATE = 9, 3, 56, 10  # 3 of 9 frames sampled (0, 4, 8): two temporal patches, one padded
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"
RECORDS = [
    {"id": "video", "video": "clip.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "Noise."}]},
    {"id": "both", "image": "a.png", "video": "clip.mp4", "conversations": [
        {"from": "human", "value": "See <image> then <video> now."}, {"from": "gpt", "value": "Both noise."}]},
    {"id": "image", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A square."}]},
]  # fmt: skip


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    write_image(root / "images" / "a.png", (70, 45), seed=0)
    write_video(root / "images" / "clip.mp4", FRAMES, size=SIDE, rate=RATE)
    with one_thread():
        hf_dir = tiny_qwen_vl_dir(root, request.param)
        ckpt = import_qwen_vl(hf_dir, root / "neva")
    return request.param, root, hf_dir, ckpt


def _samples(ckpt, root):
    meta, cfg = load_metadata(ckpt), load_config(ckpt)
    spec = QwenImageSpec.for_tower(cfg.vision, meta["min_pixels"], meta["max_pixels"])
    model, tokenizer, settings, front_end = checkpoint_data_path(
        ckpt,
        video_tokens=partial(native_video_estimate, spec),
        video_token_id=cfg.video_token_id,
        num_frames=NUM_FRAMES,
    )
    assert model.modalities == ("image", "video")  # the imported video token makes it take video
    images = FolderImageSource(str(root / "images"))
    videos = VideoSource(str(root / "images"), VideoLimits(NUM_FRAMES))
    samples = [process_record(r, settings, images, front_end, videos) for r in RECORDS]
    return model, tokenizer, settings, samples


def _hf_patchify(frames: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' ``Qwen2VLVideoProcessor.patchify`` (5.25) for one video ``[F, C, H, W]``."""
    if pad := -frames.shape[0] % temporal:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)))
    f, c, h, w = frames.shape
    t, gh, gw = f // temporal, h // patch, w // patch
    x = frames.reshape(1, t, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(t * gh * gw, c * temporal * patch * patch), [t, gh, gw]


def _hf_inputs(tokenizer, settings, record, root, family, text: str | None = None) -> dict:
    """What HF's Qwen-VL processor gives for the record (its video block written where the ``<video>`` tag is), or
    for ``text`` with the record's image and its video (a record with an ``image`` key has the video too)."""
    if text is None:
        convs = [dict(c, value=c["value"].replace("<video>", VIDEO_BLOCK)) for c in record["conversations"]]
        text = settings.template.render(parse_conversations(convs)).text
    video = "video" in record or text.count("<|video_pad|>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    image_pad, video_pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
    out, counts = {}, {}
    if "image" in record:
        image = Image.open(root / "images" / record["image"]).convert("RGB")
        out.update(image_processor(*pixel_budget(family), model_type=family)(images=[image], return_tensors="pt"))
        counts[image_pad] = int(out["image_grid_thw"].prod()) // MERGE**2
    if video:
        indices = np.linspace(0, FRAMES - 1, NUM_FRAMES, dtype=int).tolist()
        frames = torch.from_numpy(np.stack(reference_decode(root / "images" / "clip.mp4", indices)))
        patches, grid = _hf_patchify(frames.permute(0, 3, 1, 2), 14, MERGE, 2)  # 56 px: no resize in the budget
        stats = image_processor(*pixel_budget(family), model_type=family)  # the video processor's mean / std too
        mean, std = (torch.tensor(x).repeat_interleave(2 * 14 * 14) for x in (stats.image_mean, stats.image_std))
        out["video_patches_uint8"] = patches
        out["pixel_values_videos"] = (patches.float() / 255 - mean) / std
        out["video_grid_thw"] = torch.tensor([grid])
        counts[video_pad] = grid[0] * grid[1] * grid[2] // MERGE**2
        if family == "qwen2_5_vl":  # the processor's temporal_patch_size / sampled_fps
            out["second_per_grid_ts"] = torch.tensor([2 / (NUM_FRAMES / FRAMES * RATE)])
    ids = torch.tensor([[x for i in ids for x in ([i] * counts[i] if i in counts else [i])]])
    kinds = (ids == image_pad).long() + 2 * (ids == video_pad).long()
    return {"input_ids": ids, "mm_token_type_ids": kinds, **out}


def _logits(model, batch):
    return model(batch.input_ids, batch.media, batch.position_ids, batch.segment_ids)


def test_video_ids_patches_and_logits_equal_transformers(imported):
    from transformers import AutoModelForImageTextToText

    family, root, hf_dir, ckpt = imported
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        model, tokenizer, settings, samples = _samples(ckpt, root)
        for record, sample in zip(RECORDS, samples):
            assert "skipped" not in sample, sample
            inputs = _hf_inputs(tokenizer, settings, record, root, family)
            assert sample["input_ids"].tolist() == inputs["input_ids"][0].tolist(), record["id"]
            if "video" in record:
                # the temporal positions of the two grids: Qwen2.5-VL's int(i × tokens_per_second (4) × 0.6 s)
                t = sample["position_ids"][0, sample["video_positions"]].unique()
                assert (t - t[0]).tolist() == ([0, 2] if family == "qwen2_5_vl" else [0, 1])
                assert torch.equal(sample["video_pixel_values"], inputs.pop("video_patches_uint8"))
                assert torch.equal(sample["video_grid"], inputs["video_grid_thw"])
            batch = collate_padded([sample], pad_id=0, position_axes=3)
            with torch.no_grad():
                ours = _logits(model, batch)[0, : sample["input_ids"].numel()]
                theirs = hf(**inputs).logits[0]
            err = rel_err(ours, theirs)
            print(family, record["id"], f"rel_err {err:.2e}")
            assert err < 1e-5, (family, record["id"], err)


def test_packed_row_with_videos_equals_each_sample_alone(imported):
    _, root, _, ckpt = imported
    with one_thread():
        model, _, _, samples = _samples(ckpt, root)
        packed = collate_packed(samples, pad_id=0, seq_length=512, position_axes=3)
        assert packed.input_ids.shape[0] == 1 and packed.media.video.grid.shape == (2, 3)
        with torch.no_grad():
            row = _logits(model, packed)[0]
            start = 0
            for sample in samples:
                n = sample["input_ids"].numel()
                alone = _logits(model, collate_padded([sample], pad_id=0, position_axes=3))[0, :n]
                assert rel_err(row[start : start + n], alone) < 1e-5
                start += n


def test_export_writes_the_video_token_and_timing_back(imported, tmp_path):
    import json

    from neva.checkpoint.hf_qwen_vl import export_qwen_vl

    family, _, hf_dir, ckpt = imported
    source = json.loads((hf_dir / "config.json").read_text())
    written = json.loads((export_qwen_vl(ckpt, tmp_path / "export") / "config.json").read_text())
    assert written["video_token_id"] == source["video_token_id"]
    if family == "qwen2_5_vl":
        assert written["vision_config"]["tokens_per_second"] == source["vision_config"]["tokens_per_second"] == 4


def test_qwen3_vl_video_is_a_counted_skip_naming_the_gap(imported):
    """Qwen3-VL writes a timestamp and its own vision block per frame: not written yet, so its videos are refused."""
    import dataclasses

    from neva.models.config import VisionConfig

    family, root, _, ckpt = imported
    if family != "qwen2_5_vl":
        pytest.skip("one family's config suffices")
    model, _, settings, _ = _samples(ckpt, root)
    v = model.cfg.vision
    qwen3 = VisionConfig(kind="qwen3_vl", num_layers=1, num_heads=2, hidden_size=32, intermediate_size=48,
                         patch_size=16, hidden_act="gelu_pytorch_tanh")  # fmt: skip
    cfg = dataclasses.replace(model.cfg, vision=qwen3, projector=dataclasses.replace(
        model.cfg.projector, type="qwen3_vl_merger", input_size=32))  # fmt: skip
    assert v.kind == "qwen2_5_vl" and cfg.patch_video
    front_end = front_end_for(cfg.vision, cfg, "square")
    images, videos = FolderImageSource(str(root / "images")), VideoSource(str(root / "images"), VideoLimits(3))
    skipped = process_record(RECORDS[0], settings, images, front_end, videos)
    assert skipped["skipped"] == "video_unsupported" and "qwen3_vl video" in skipped["detail"]


def test_greedy_generation_with_a_video_equals_transformers(imported):
    """Served: a video prompt and a video-and-image prompt in one left-padded batch, equal to HF generate (served
    frames carry no timing: Qwen2.5-VL's positions take HF's default of one second per grid, given to neither)."""
    import dataclasses

    from transformers import AutoModelForImageTextToText

    from neva.data.templates.base import Message
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    family, root, hf_dir, ckpt = imported
    indices = np.linspace(0, FRAMES - 1, NUM_FRAMES, dtype=int).tolist()
    frames = np.stack(reference_decode(root / "images" / "clip.mp4", indices))
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=6))
        answerer.generation = dataclasses.replace(answerer.generation, eos_token_ids=(), stop_strings=())
        items = [("<video>\nWhat happens?", [], [frames]), ("See <image> then <video> now.", [root / "images/a.png"],
                 [frames])]  # fmt: skip
        prepared = [answerer.prepare(item) for item in items]
        ours = answerer.generate_ids(prepared)
        record = {"conversations": []}
        for p, (prompt, images, _), got in zip(prepared, items, ours):
            text = answerer.builder.template.render_prompt([Message("user", prompt.replace("<video>", VIDEO_BLOCK))])
            inputs = _hf_inputs(answerer.tokenizer, None, dict(record, image=images[0].name) if images else record,
                                root, family, text=text)  # fmt: skip
            inputs.pop("video_patches_uint8")
            inputs.pop("second_per_grid_ts", None)
            assert inputs["input_ids"][0].tolist() == p.ids
            out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert got == out[0, len(p.ids) :].tolist(), family
