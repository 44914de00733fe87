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
