"""HF interop of video: transformers' LlavaNextVideoForConditionalGeneration (tiny random, built with its classes) in
and out: logits with a video and with an image + video prompt, greedy generation with the KV cache, export → reload,
the per-frame pool against LlavaNextVideoPooler, the frames' pixels against LLaVA-NeXT-Video's processor."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextVideoConfig,
    LlavaNextVideoForConditionalGeneration,
)
from transformers.models.llava_next_video.modeling_llava_next_video import LlavaNextVideoPooler

from neva.checkpoint.hf_config import neva_config_from_llava
from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.neva_format import iter_tensors, load_config, load_model
from neva.data.anyres import tile_image
from neva.data.images import ImageProcessor
from neva.inference import Answerer
from neva.models.anyres import batch_feature_index
from neva.models.generation import GenerationConfig, generate
from neva.models.media import Media, MediaInputs
from neva.models.video import VideoConfig, VideoPool
from neva.models.vision import normalize_pixels
from tests.checkpoint.tiny_hf import SP_VOCAB, make_tokenizer
from tests.hf_oracle import TEXT_KW, VISION_KW, randomise_inits

FRAMES = 3
VIDEO_TOKEN = SP_VOCAB + 2  # after <pad> (320) and <image> (321)


def tiny_llava_next_video(seed: int = 0, **kw) -> LlavaNextVideoForConditionalGeneration:
    """A random LlavaNextVideo model (fp32, eval): the tiny CLIP (4×4 patches → 2×2 pooled tokens per frame)."""
    torch.manual_seed(seed)
    s = VISION_KW["image_size"]
    cfg = LlavaNextVideoConfig(
        vision_config=CLIPVisionConfig(**VISION_KW),
        text_config=LlamaConfig(**{**TEXT_KW, "vocab_size": SP_VOCAB + 3, "pad_token_id": SP_VOCAB}),
        image_token_index=SP_VOCAB + 1,
        video_token_index=VIDEO_TOKEN,
        image_grid_pinpoints=[[s, 2 * s], [2 * s, s], [2 * s, 2 * s]],
        **kw,
    )
    model = LlavaNextVideoForConditionalGeneration(cfg).eval()
    randomise_inits(model)
    return model


@pytest.fixture(scope="module")
def hf_video(tmp_path_factory):
    """The HF model's directory and the processor for its prompts: LlavaNextProcessor expands ``<image>`` as
    LlavaNextVideoProcessor does (transformers 5 builds the latter only with torchvision, not installed here; the
    ``<video>`` tags are expanded in the prompts, as its ``replace_video_token`` does)."""
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    root = tmp_path_factory.mktemp("hf_video")
    tokenizer = make_tokenizer(root / "_sp")
    tokenizer.add_special_tokens({"extra_special_tokens": ["<video>"]}, replace_extra_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<video>") == VIDEO_TOKEN
    model = tiny_llava_next_video()
    s = VISION_KW["image_size"]
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": s}, crop_size={"height": s, "width": s},
        image_grid_pinpoints=model.config.image_grid_pinpoints,
    )  # fmt: skip
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=VISION_KW["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    model.save_pretrained(str(root / "hf"))
    tokenizer.save_pretrained(str(root / "hf"))
    image_processor.save_pretrained(str(root / "hf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no neva chat template in the source
        ckpt = import_llava(root / "hf", root / "ckpt", metadata={"conv_template": "vicuna_v1"})
    return model, processor, ckpt


def _frames(seed: int = 3) -> torch.Tensor:
    """Normalised frames ``[F, 3, s, s]`` (HF's pixel_values_videos of one video; torchvision, which transformers'
    video processor needs, is not installed here: the processing is checked on its own below)."""
    s = VISION_KW["image_size"]
    return torch.randn(FRAMES, 3, s, s, generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_llava_next_video_import_logits_generate_export_reload(hf_video, tmp_path):
    hf, processor, ckpt = hf_video
    cfg = load_config(ckpt)
    assert cfg.video == VideoConfig(2, "average") and cfg.video_token_id == VIDEO_TOKEN and cfg.anyres is not None
    assert cfg.video_tokens(FRAMES) == FRAMES * 4
    model = load_model(ckpt).eval()
    frames = _frames()
    video_tags = "<video>" * cfg.video_tokens(FRAMES)  # what LlavaNextVideoProcessor expands <video> to

    # a video alone
    ids = processor.tokenizer(f"USER: {video_tags}\nWhat moves? ASSISTANT:", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values_videos=frames[None]).logits
        got = model(ids, Media(video=MediaInputs(frames)))
    assert _rel(got, expected) <= 1e-5

    # an AnyRes image and a video in one prompt (the processor expands the image; the video tags are expanded above)
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (26, 70, 3), dtype=np.uint8))
    text = f"USER: <image>\n{video_tags}\nWhat changed? ASSISTANT:"
    inputs = processor(images=[image], text=text, return_tensors="pt")
    size = (image.size[1], image.size[0])
    tiles = tile_image(image, cfg.anyres, cfg.vision.image_size)  # uint8, neva's tiling
    index = batch_feature_index(cfg.anyres, cfg.num_image_tokens, cfg.vision.image_size, [size])[0].index
    assert int((inputs.input_ids == VIDEO_TOKEN).sum()) == cfg.video_tokens(FRAMES)
    with torch.no_grad():
        expected = hf(**inputs, pixel_values_videos=frames[None]).logits
        media = Media(
            image=MediaInputs(
                tiles, (inputs.input_ids == cfg.image_token_id).nonzero(), torch.tensor([1]), index=index
            ),
            video=MediaInputs(frames, (inputs.input_ids == VIDEO_TOKEN).nonzero()),
        )
        got = model(inputs.input_ids, media)
    assert _rel(got, expected) <= 1e-5

    # greedy generation with the KV cache: the same new tokens as transformers' generate
    with torch.no_grad():
        theirs = hf.generate(**inputs, pixel_values_videos=frames[None], max_new_tokens=6, min_new_tokens=6,
                             do_sample=False)[0, inputs.input_ids.shape[1]:]  # fmt: skip
    ours = generate(
        model, [inputs.input_ids[0].tolist()], tiles, [1], GenerationConfig(max_new_tokens=6), image_sizes=[size],
        video_pixel_values=frames,
    )[0]  # fmt: skip
    assert ours == theirs.tolist()

    # the inference front end (neva.generate / neva.evaluate): a video as uint8 RGB frames, each processed as the
    # tower's images; LlavaNextVideoProcessor's ids (its <video> expansion), transformers' greedy answer
    answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=6), raw=True)
    raw = np.random.default_rng(9).integers(0, 256, (FRAMES, 30, 40, 3), dtype=np.uint8)
    prepared = answerer.prepare(("USER: <image>\n<video>\nWhat changed? ASSISTANT:", [image], [raw]))
    ids, pixels, sizes, got_frames, *_ = prepared
    assert ids == inputs.input_ids[0].tolist() and sizes == [size] and torch.equal(pixels, tiles)
    assert torch.equal(got_frames, torch.stack([ImageProcessor(cfg.vision)(Image.fromarray(f)) for f in raw]))
    video = normalize_pixels(got_frames, cfg.vision.image_mean, cfg.vision.image_std)[None]
    with torch.no_grad():
        theirs = hf.generate(**inputs, pixel_values_videos=video, max_new_tokens=6, min_new_tokens=6,
                             do_sample=False)[0, inputs.input_ids.shape[1]:]  # fmt: skip
    assert answerer._generate([prepared]) == [answerer.tokenizer.decode(theirs, skip_special_tokens=True)]
    with pytest.raises(ValueError, match="1 <video> tag"):
        answerer.prepare(("USER: <video>\nWhat? ASSISTANT:", [], [raw, raw]))

    # export: LlavaNextVideo config, processor and weights; transformers reloads identical logits
    out = export_llava(ckpt, tmp_path / "hf2")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlavaNextVideoForConditionalGeneration"]
    assert config["model_type"] == "llava_next_video" and config["video_token_index"] == VIDEO_TOKEN
    assert (config["spatial_pool_stride"], config["spatial_pool_mode"]) == (2, "average")
    reloaded, info = LlavaNextVideoForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    processor_config = json.loads((out / "processor_config.json").read_text())
    assert processor_config["video_token"] == "<video>"
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(**inputs, pixel_values_videos=frames[None]).logits, expected)
    again = dict(iter_tensors(import_llava(out, tmp_path / "ckpt2")))
    for key, tensor in iter_tensors(ckpt):
        assert torch.equal(tensor, again.pop(key)), key
    assert not again


@pytest.mark.parametrize(("mode", "grid"), [("average", 4), ("max", 5)])
def test_video_pool_is_transformers_pooler(mode, grid):
    """Average and max over stride-2 windows, an odd grid's last row and column dropped (no padding)."""
    hf_cfg = LlavaNextVideoConfig(
        vision_config=CLIPVisionConfig(**{**VISION_KW, "image_size": grid * 7}), spatial_pool_mode=mode
    )
    feats = torch.randn(3, grid * grid, 8)
    expected = LlavaNextVideoPooler(hf_cfg)(feats)
    got = VideoPool(VideoConfig(2, mode))(feats)
    assert got.shape == (3, (grid // 2) ** 2, 8) and torch.equal(got, expected)


def test_import_refuses_what_neva_does_not_compute():
    base = tiny_llava_next_video().config.to_dict()
    with pytest.raises(ValueError, match="spatial_pool_mode='conv'"):
        neva_config_from_llava({**base, "spatial_pool_mode": "conv"})
    with pytest.raises(ValueError, match="spatial_pool_out_channels"):
        neva_config_from_llava({**base, "spatial_pool_out_channels": 64})
    with pytest.raises(ValueError, match="vision_select_feature=patch"):  # a class token has no place in the grid
        neva_config_from_llava({**base, "vision_feature_select_strategy": "full"})


def test_export_refuses_a_video_model_without_anyres():
    import dataclasses

    from neva.checkpoint.hf_config import llava_config_dict

    cfg = neva_config_from_llava(tiny_llava_next_video().config.to_dict())
    with pytest.raises(ValueError, match="without AnyRes has no transformers class"):
        llava_config_dict(dataclasses.replace(cfg, anyres=None))


T4_VIDEO_PROCESSOR_SCRIPT = r"""
import sys
import numpy as np, transformers
from transformers import LlavaNextVideoImageProcessor
assert transformers.__version__.startswith("4.46"), transformers.__version__
frames, size, out = np.load(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
proc = LlavaNextVideoImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
np.save(out, proc([frames], return_tensors="np")["pixel_values_videos"][0])
"""


def test_frames_are_processed_as_llava_next_video_processes_them(tmp_path):
    """neva's per-frame processing (the tower's image processing on each frame, uint8, normalised on the device)
    equals LLaVA-NeXT-Video's processor on the same numpy frames. transformers 5's video processor needs torchvision
    (not installed here); transformers 4.46's ``LlavaNextVideoImageProcessor`` is the same recipe in numpy / PIL."""
    import os
    import subprocess
    import sys

    from tests.checkpoint.test_hf_export_template import transformers_4_site

    site = transformers_4_site()
    frames = np.random.default_rng(7).integers(0, 256, (FRAMES, 30, 40, 3), dtype=np.uint8)  # not the tower's size
    np.save(tmp_path / "frames.npy", frames)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    s = VISION_KW["image_size"]
    args = [str(tmp_path / "frames.npy"), str(s), str(tmp_path / "hf.npy")]
    proc = subprocess.run([sys.executable, "-c", T4_VIDEO_PROCESSOR_SCRIPT, *args], env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = torch.from_numpy(np.load(tmp_path / "hf.npy"))
    vision = load_vision()
    pixels = torch.stack([ImageProcessor(vision)(Image.fromarray(f)) for f in frames])
    assert pixels.dtype == torch.uint8 and pixels.shape == (FRAMES, 3, s, s)
    torch.testing.assert_close(normalize_pixels(pixels, vision.image_mean, vision.image_std), expected,
                               rtol=0, atol=1e-6)  # fmt: skip


def load_vision():
    return neva_config_from_llava(tiny_llava_next_video().config.to_dict()).vision
