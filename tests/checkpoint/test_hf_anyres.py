"""HF interop of AnyRes: llava-hf LlavaNextForConditionalGeneration (tiny random, built with transformers' classes)
in and out with LlavaNextProcessor, CLIP and SigLIP: logits, greedy generation with the KV cache, export → reload."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaNextForConditionalGeneration, LlavaNextProcessor

from neva.checkpoint.hf_config import llava_config_dict
from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.neva_format import iter_tensors, load_config, load_model
from neva.data.anyres import tile_image
from neva.inference import Answerer
from neva.models.generation import GenerationConfig, generate
from neva.models.media import image_media
from tests.checkpoint.tiny_hf import SP_VOCAB, make_tokenizer
from tests.hf_oracle import tiny_llava_next

# two images of different grids (wide: 1x2 or 1x3, tall: 2x1 / 3x1), not multiples of the tile
SIZES = [(70, 26), (24, 61)]


def _images():
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


def _hf_dir(root, tower: str):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = make_tokenizer(root / "_sp")
    model = tiny_llava_next(7, text_kw={"vocab_size": SP_VOCAB + 2, "pad_token_id": SP_VOCAB}, tower=tower)
    v = model.config.vision_config
    stats = {} if tower == "clip" else dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": v.image_size},
        crop_size={"height": v.image_size, "width": v.image_size},
        image_grid_pinpoints=model.config.image_grid_pinpoints,
        **stats,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=v.patch_size,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        num_additional_image_tokens=0 if tower == "siglip" else 1,
    )
    model.save_pretrained(str(root / "hf"))
    processor.save_pretrained(str(root / "hf"))
    return model, processor


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_llava_next_import_generate_export_reload(tmp_path, tower):
    hf, processor = _hf_dir(tmp_path, tower)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no neva chat template in the source
        ckpt = import_llava(tmp_path / "hf", tmp_path / "ckpt", metadata={"conv_template": "vicuna_v1"})
    cfg = load_config(ckpt)
    assert cfg.anyres is not None and cfg.anyres.grid_pinpoints == hf.config.image_grid_pinpoints
    model = load_model(ckpt).eval()
    imgs = _images()
    inputs = processor(images=imgs, text="USER: <image>\n<image>\nWhat is it? ASSISTANT:", return_tensors="pt")
    sizes = [(im.size[1], im.size[0]) for im in imgs]
    assert int((inputs.input_ids == cfg.image_token_id).sum()) == sum(cfg.image_tokens(s) for s in sizes)
    tiles = torch.cat([tile_image(im, cfg.anyres, cfg.vision.image_size) for im in imgs])  # uint8, neva's tiling
    with torch.no_grad():
        expected = hf(**inputs).logits
        positions = (inputs.input_ids == cfg.image_token_id).nonzero()
        got = model(
            inputs.input_ids, image_media(tiles, torch.tensor([2]), positions=positions, index=_index(cfg, sizes))
        )
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5

    # greedy generation with the KV cache: the same new tokens as transformers' generate
    with torch.no_grad():
        theirs = hf.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)[
            0, inputs.input_ids.shape[1] :
        ]
    ours = generate(
        model, [inputs.input_ids[0].tolist()], tiles, [2], GenerationConfig(max_new_tokens=6), image_sizes=sizes
    )[0]
    assert ours == theirs.tolist()
    # the inference front end (neva.generate / neva.evaluate): LlavaNextProcessor's ids, neva's tiles, the same answer
    answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=6), raw=True)
    prepared = answerer.prepare(("USER: <image>\n<image>\nWhat is it? ASSISTANT:", imgs))
    assert prepared[0] == inputs.input_ids[0].tolist() and prepared[2] == sizes and torch.equal(prepared[1], tiles)
    assert answerer._generate([prepared]) == [answerer.tokenizer.decode(theirs, skip_special_tokens=True)]

    _check_preview(tmp_path, ckpt, imgs, cfg)

    # export: LlavaNext config, processor and weights; transformers reloads identical logits
    out = export_llava(ckpt, tmp_path / "hf2")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlavaNextForConditionalGeneration"] and config["model_type"] == "llava_next"
    reloaded, info = LlavaNextForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    processor2 = AutoProcessor.from_pretrained(out)
    assert isinstance(processor2, LlavaNextProcessor)
    inputs2 = processor2(images=imgs, text="USER: <image>\n<image>\nWhat is it? ASSISTANT:", return_tensors="pt")
    assert torch.equal(inputs2.input_ids, inputs.input_ids)
    torch.testing.assert_close(inputs2.pixel_values, inputs.pixel_values, rtol=0, atol=0)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(**inputs2).logits, expected)
    again = dict(iter_tensors(import_llava(out, tmp_path / "ckpt2")))
    for key, tensor in iter_tensors(ckpt):
        assert torch.equal(tensor, again.pop(key)), key
    assert not again


def _index(cfg, sizes):
    from neva.models.anyres import batch_feature_index

    return batch_feature_index(cfg.anyres, cfg.num_image_tokens, cfg.vision.image_size, sizes)[0].index


def test_export_refuses_layouts_transformers_lacks():
    from neva.models.anyres import AnyResConfig
    from neva.models.presets import build_config

    base = build_config()
    cfg = dataclasses.replace(base, anyres=AnyResConfig(grid_pinpoints=[[32, 64]], patch_merge_type="spatial"))
    with pytest.raises(ValueError, match="spatial_unpad"):
        llava_config_dict(cfg)


def _check_preview(tmp_path, ckpt, imgs, cfg):
    """``neva.data.preview`` on the AnyRes checkpoint: each image's grid, tiles and positions, as training encodes."""
    import io

    from neva.data.preview import build_parser, preview
    from neva.models.anyres import grid_shape

    folder = tmp_path / "images"
    folder.mkdir()
    for k, im in enumerate(imgs):
        im.save(folder / f"{k}.png")
    record = {"id": "a", "image": ["0.png", "1.png"], "conversations": [
        {"from": "human", "value": "<image>\n<image>\nWhat is it?"}, {"from": "gpt", "value": "a test"}]}  # fmt: skip
    (tmp_path / "d.json").write_text(json.dumps([record]))
    args = build_parser().parse_args(
        ["--data-path", str(tmp_path / "d.json"), "--image-folder", str(folder), "--conv-template", "vicuna_v1",
         "--tokenizer", str(ckpt), "--json"]
    )  # fmt: skip
    out = io.StringIO()
    assert preview(args, out) == 0
    row = json.loads(out.getvalue())
    for image, im in zip(row["images"], imgs):
        size = (im.size[1], im.size[0])
        assert image["size"] == list(size) and image["grid"] == list(
            grid_shape(size, cfg.anyres.grid_pinpoints, cfg.vision.image_size)
        )
        assert image["tiles"] == 1 + image["grid"][0] * image["grid"][1] and image["tokens"] == cfg.image_tokens(size)
        start, end = image["positions"]
        assert set(row["input_ids"][start:end]) == {cfg.image_token_id} and end - start == image["tokens"]
    assert row["input_ids"].count(cfg.image_token_id) == sum(i["tokens"] for i in row["images"])
    args.json = False
    args.color = False
    out = io.StringIO()
    preview(args, out)
    assert "grid" in out.getvalue() and "positions [" in out.getvalue()


T4_LLAVA_NEXT_SCRIPT = r"""
import json, sys
import torch, transformers
from PIL import Image
from transformers import AutoProcessor, LlavaNextForConditionalGeneration
assert transformers.__version__.startswith("4.46"), transformers.__version__
out, root, text = sys.argv[1:4]
torch.set_num_threads(1)
model, info = LlavaNextForConditionalGeneration.from_pretrained(out, output_loading_info=True)
assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
proc = AutoProcessor.from_pretrained(out)
inputs = proc(images=[Image.open(f"{root}/{k}.png") for k in range(2)], text=text, return_tensors="pt")
with torch.no_grad():
    gen = model.eval().generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
print(json.dumps({"processor": type(proc.image_processor).__name__, "ids": inputs.input_ids[0].tolist(),
                  "new": gen[0, inputs.input_ids.shape[1]:].tolist()}))
"""


def test_llava_next_export_generates_the_same_under_transformers_4(tmp_path):
    import os
    import subprocess
    import sys

    from tests.checkpoint.test_hf_export_template import transformers_4_site

    site = transformers_4_site()
    hf, processor = _hf_dir(tmp_path, "clip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = import_llava(tmp_path / "hf", tmp_path / "ckpt", metadata={"conv_template": "vicuna_v1"})
    out = export_llava(ckpt, tmp_path / "hf2")
    imgs = _images()
    for k, im in enumerate(imgs):
        im.save(tmp_path / f"{k}.png")
    text = "USER: <image>\n<image>\nWhat is it? ASSISTANT:"
    inputs = processor(images=imgs, text=text, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)[
            0, inputs.input_ids.shape[1] :
        ]
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", T4_LLAVA_NEXT_SCRIPT, str(out), str(tmp_path), text],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["processor"] == "LlavaNextImageProcessor"
    assert got["ids"] == inputs.input_ids[0].tolist() and got["new"] == theirs.tolist()
