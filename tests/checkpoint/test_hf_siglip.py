"""HF interop of SigLIP towers: llava-hf with a SigLIP vision config in and out (transformers 5 and 4.46), a
standalone SigLIP directory for stage 1, and the refusal to export NeMo's mlp_downsample projector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration, SiglipImageProcessor, SiglipVisionModel

from neva.checkpoint.hf_assemble import import_llm_and_vision, load_hf_weights
from neva.checkpoint.hf_config import llava_config_dict
from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.neva_format import iter_tensors, load_config, load_model
from neva.data.images import ImageProcessor
from neva.inference import Answerer
from neva.models.generation import GenerationConfig, generate
from neva.models.media import image_media
from neva.models.neva import NevaModel
from neva.models.presets import build_config
from neva.models.vision import normalize_pixels
from tests.checkpoint.test_hf_export_template import transformers_4_site, with_metadata
from tests.checkpoint.tiny_hf import SP_VOCAB, make_llama_dir, make_llava_dir, make_siglip_dir

IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8))  # not square


@pytest.fixture(scope="module")
def siglip_llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("siglip_llava")
    hf, tokenizer = make_llava_dir(root / "hf", seed=6, tower="siglip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no neva chat template in the source: vicuna_v1, warned
        ckpt = import_llava(root / "hf", root / "ckpt", metadata={"conv_template": "vicuna_v1"})
    return root, hf, tokenizer, ckpt


def test_llava_siglip_import_export_reloads_with_identical_logits(siglip_llava):
    root, hf, _, ckpt = siglip_llava
    cfg = load_config(ckpt)
    assert cfg.vision.kind == "siglip" and cfg.vision.image_mean == (0.5, 0.5, 0.5)
    assert cfg.num_image_tokens == 25 == hf.config.image_seq_length
    out = export_llava(ckpt, root / "hf2")
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["model_type"] == "siglip_vision_model"
    assert config["vision_config"]["vision_use_head"] is False and config["vision_feature_select_strategy"] == "full"

    reloaded, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    sd, sd2 = hf.state_dict(), reloaded.state_dict()
    assert set(sd) - set(sd2) == {k for k in sd if k.startswith("model.vision_tower.head.")}  # dropped at import
    for key in sd2:
        assert torch.equal(sd[key], sd2[key]), key

    processor = AutoProcessor.from_pretrained(out)
    assert isinstance(processor.image_processor, SiglipImageProcessor)
    inputs = processor(images=[IMAGE], text="USER: <image>\nWhat is it? ASSISTANT:", return_tensors="pt")
    assert (inputs.input_ids == cfg.image_token_id).sum() == 25
    # the exported processor's pixels are neva's (resize to the square, mean/std 0.5)
    ours = ImageProcessor(cfg.vision)(IMAGE)[None]
    torch.testing.assert_close(
        normalize_pixels(ours, cfg.vision.image_mean, cfg.vision.image_std), inputs.pixel_values, rtol=0, atol=1e-6
    )
    with torch.no_grad():
        expected = hf(**inputs).logits
        assert torch.equal(reloaded.eval()(**inputs).logits, expected)
        got = load_model(ckpt)(inputs.input_ids, image_media(ours))  # uint8 pixels, normalised in the tower
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5

    again = import_llava(out, root / "ckpt2")
    first = dict(iter_tensors(ckpt))
    for key, tensor in iter_tensors(again):
        assert torch.equal(tensor, first.pop(key)), key
    assert not first


# transformers 4.46's LlavaProcessor counts one class token for every tower (its ``+ 1`` is hard-coded; it has no
# ``num_additional_image_tokens``), 26 positions for SigLIP's 25 features: its model and image processor are used with
# neva's prompt ids.
T4_SIGLIP_SCRIPT = r"""
import json, sys
import torch, transformers
from PIL import Image
from transformers import AutoImageProcessor, LlavaForConditionalGeneration
assert transformers.__version__.startswith("4.46"), transformers.__version__
out, ids = sys.argv[1], json.loads(sys.argv[2])
torch.set_num_threads(1)
model, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
processor = AutoImageProcessor.from_pretrained(out)
pixels = processor(images=[Image.new("RGB", (40, 30), (200, 30, 30))], return_tensors="pt").pixel_values
with torch.no_grad():
    gen = model.eval().generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=6,
                                min_new_tokens=6, do_sample=False)
print(json.dumps({"processor": type(processor).__name__, "pixels": pixels.flatten().tolist(),
                  "new": gen[0, len(ids):].tolist()}))
"""


def test_llava_siglip_export_generates_the_same_under_transformers_4(siglip_llava, tmp_path):
    site = transformers_4_site()
    _, _, _, ckpt = siglip_llava
    src = with_metadata(ckpt, tmp_path / "ckpt", conv_template="vicuna_v1", precision="32")
    out = export_llava(src, tmp_path / "hf")
    answerer = Answerer(src, GenerationConfig(max_new_tokens=6))
    ids, pixels, *_ = answerer.prepare(("What is it?", [Image.new("RGB", (40, 30), (200, 30, 30))]))
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", T4_SIGLIP_SCRIPT, str(out), json.dumps(ids)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["processor"] == "SiglipImageProcessor"
    cfg = answerer.model.cfg.vision
    ours = normalize_pixels(pixels, cfg.image_mean, cfg.image_std) if pixels.dtype == torch.uint8 else pixels
    torch.testing.assert_close(torch.tensor(got["pixels"]), ours.flatten(), rtol=0, atol=1e-6)
    with torch.no_grad():
        neva_new = generate(answerer.model, [ids], pixels, [1], GenerationConfig(max_new_tokens=6))[0]
    assert neva_new == got["new"][: len(neva_new)]


def test_standalone_siglip_directory_for_stage_1(tmp_path):
    llama, _ = make_llama_dir(tmp_path / "llama")
    siglip = make_siglip_dir(tmp_path / "siglip")
    ckpt = import_llm_and_vision(tmp_path / "llama", tmp_path / "siglip", tmp_path / "ckpt", vision_select_layer=-2)
    cfg = load_config(ckpt)
    assert cfg.vision.kind == "siglip" and cfg.num_image_tokens == 25 and cfg.vision.class_tokens == 0
    model = load_model(ckpt)
    vision = siglip.vision_model.state_dict()
    assert torch.equal(model.vision.patch_embed.bias, vision["embeddings.patch_embedding.bias"])
    assert torch.equal(model.vision.post_norm.weight, vision["post_layernorm.weight"])
    pixels = torch.randn(1, 3, 35, 35)
    with torch.no_grad():
        expected = siglip.vision_model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        assert ((model.vision.features(pixels) - expected).norm() / expected.norm()).item() < 1e-5
    # the training path (model.mm_cfg.vision_encoder.from_pretrained) loads the same tower into a fresh model
    # from a SiglipModel directory or a SiglipVisionModel one (transformers 5 saves it without a prefix)
    tower_only = tmp_path / "tower"
    SiglipVisionModel.from_pretrained(str(tmp_path / "siglip")).save_pretrained(str(tower_only))
    imported = model.state_dict()
    for directory in (tmp_path / "siglip", tower_only):
        fresh = NevaModel(cfg)
        fresh.init_weights()
        load_hf_weights(fresh, tmp_path / "llama", directory)
        for key, value in fresh.state_dict().items():
            if key.startswith("vision."):
                assert torch.equal(value, imported[key]), (directory, key)
    assert len(model.llm.tok_embeddings.weight) == SP_VOCAB + 2 and llama is not None


def test_mlp_downsample_export_is_refused_with_the_reason():
    cfg = build_config(vision="tiny_siglip", projector_type="mlp_downsample")
    with pytest.raises(ValueError, match="transformers has no llava-hf class with NeMo's 2x2 patch merge"):
        llava_config_dict(cfg)
