"""``neva.convert neva-to-llava``: a neva checkpoint in LLaVA's own layout, read back by neva's LLaVA-original reader
into the same model (every tensor, the architecture, the tokenizer's ids, the logits), whole or as LLaVA's pretrain
output (``config.json`` + ``mm_projector.bin`` beside the decoder it started from); models LLaVA's classes cannot
express are refused with the reason."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from neva.checkpoint.llava_export import export_llava_original
from neva.checkpoint.llava_original import import_llava_original
from neva.checkpoint.neva_format import iter_tensors, load_config, load_model, load_tokenizer, save_checkpoint
from neva.convert import main as convert_main
from neva.models.media import image_media
from neva.typed import ConfigError
from tests.checkpoint.tiny_llava_original import make_llava_original, make_tower


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def same_tensors(a, b) -> None:
    got, expected = dict(iter_tensors(a)), dict(iter_tensors(b))
    assert set(got) == set(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """neva checkpoints of a whole LLaVA model (a tokenizer with a user-defined piece) and of a pretrain output."""
    root = tmp_path_factory.mktemp("llava_export")
    tower = make_tower(root / "clip")
    make_llava_original(root / "llava", tower, user_pieces=("USER",))
    make_llava_original(root / "pre", tower, seed=5, pretrain_only=True)
    whole = quiet(import_llava_original, root / "llava", root / "whole")
    pretrain = quiet(import_llava_original, root / "pre", root / "pretrain", llm=root / "pre_llm")
    return root, whole, pretrain


def test_export_reads_back_as_the_same_model(checkpoints, tmp_path):
    _, whole, _ = checkpoints
    convert_main(["neva-to-llava", "--ckpt", str(whole), "--out", str(tmp_path / "llava")])
    config = json.loads((tmp_path / "llava" / "config.json").read_text())
    assert config["model_type"] == "llava_llama" and config["mm_projector_type"] == "mlp2x_gelu"
    assert config["mm_vision_tower"] == str((tmp_path / "llava" / "vision_tower").resolve())
    again = quiet(import_llava_original, tmp_path / "llava", tmp_path / "again")
    same_tensors(again, whole)
    assert load_config(again) == load_config(whole)
    text = "A chat. USER: <image>\nWhat is it? ASSISTANT: a red ball"
    assert load_tokenizer(again)(text)["input_ids"] == load_tokenizer(whole)(text)["input_ids"]
    # identical weights and architecture: identical logits (checked, not assumed)
    cfg = load_config(whole)
    ids = torch.tensor([[1, 5, *[cfg.image_token_id] * cfg.num_image_tokens, 7, 9]])
    pixels = torch.randn(1, 3, cfg.vision.image_size, cfg.vision.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [load_model(d).eval()(ids, image_media(pixels)) for d in (whole, again)]
    assert torch.equal(logits[0], logits[1])


def test_projector_only_export_is_llava_pretrain_output(checkpoints, tmp_path):
    root, _, pretrain = checkpoints
    export_llava_original(pretrain, tmp_path / "pre", projector_only=True)
    assert sorted(p.name for p in (tmp_path / "pre").iterdir()) == ["config.json", "mm_projector.bin", "vision_tower"]
    again = quiet(import_llava_original, tmp_path / "pre", tmp_path / "again", llm=root / "pre_llm")
    same_tensors(again, pretrain)


def test_models_llava_cannot_express_are_refused(checkpoints, tmp_path):
    _, whole, _ = checkpoints
    cfg = load_config(whole)
    bad = dataclasses.replace(cfg, projector=dataclasses.replace(cfg.projector, bias=False))
    tensors = {k: v for k, v in iter_tensors(whole) if not k.startswith("projector.") or k.endswith("weight")}
    save_checkpoint(tmp_path / "nobias", bad, tensors, load_tokenizer(whole))
    with pytest.raises(ConfigError, match="bias=False"):
        export_llava_original(tmp_path / "nobias", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# LLaVA's own loader on the export (its cached environment: llava-torch 1.2.2.post1, transformers 4.36): the model,
# tokenizer and tower load as load_pretrained_model loads them (fp16, as it always casts), are cast back to fp32 (the
# export is written in fp16, so nothing is lost), and give their logits for the same ids (-200 at the image) and
# pixels, and their tokenizer's ids.
LLAVA_DRIVER = r"""
import json, sys
import torch
torch.set_num_threads(1)
from llava.model.builder import load_pretrained_model
path, ids, text = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
tokenizer, model, processor, _ = load_pretrained_model(path, None, "llava-neva-export", device_map="cpu", device="cpu")
model = model.float().eval()
model.get_vision_tower().float()
pixels = torch.load(sys.argv[4])
with torch.no_grad():
    logits = model(input_ids=torch.tensor([ids]), images=pixels).logits
torch.save(logits, sys.argv[5])
print(json.dumps({"ids": tokenizer(text).input_ids, "class": type(tokenizer).__name__}))
"""


@pytest.mark.slow
def test_llava_load_pretrained_model_loads_the_export(checkpoints, tmp_path):
    import os
    import subprocess
    import sys

    from tests.pip_site import cached_site
    from tests.training.test_llava_trainer import LLAVA_IMAGE, LLAVA_PINS

    _, whole, _ = checkpoints
    export_llava_original(whole, tmp_path / "llava-export", dtype=torch.float16)
    reference = quiet(import_llava_original, tmp_path / "llava-export", tmp_path / "ref")  # the fp16 weights
    cfg = load_config(reference)
    pixels = torch.randn(1, 3, cfg.vision.image_size, cfg.vision.image_size, generator=torch.Generator().manual_seed(0))
    torch.save(pixels, tmp_path / "pixels.pt")
    text = "A chat. USER: hi there ASSISTANT: a red ball"
    site = cached_site("llava-torch-1.2.2.post1", LLAVA_PINS)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", LLAVA_DRIVER, str(tmp_path / "llava-export"), json.dumps([1, 5, LLAVA_IMAGE, 7, 9]),
           text, str(tmp_path / "pixels.pt"), str(tmp_path / "logits.pt")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, encoding="utf-8", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs["class"] == "LlamaTokenizer"
    assert theirs["ids"] == load_tokenizer(reference)(text)["input_ids"]
    ids = torch.tensor([[1, 5, *[cfg.image_token_id] * cfg.num_image_tokens, 7, 9]])
    with torch.no_grad():
        ours = load_model(reference, dtype=torch.float32).eval()(ids, image_media(pixels))
    llava = torch.load(tmp_path / "logits.pt")
    assert llava.shape == ours.shape
    torch.testing.assert_close(llava, ours, rtol=1e-4, atol=1e-5)
    print(f"\nLLaVA load_pretrained_model vs neva logits: max abs diff {(llava - ours).abs().max().item():.2e}")
