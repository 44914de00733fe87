"""LLaVA-original import: ``config.json`` read as it is (no AutoConfig: ``llava_llama`` is no transformers model
type), every ``mm_*`` key mapped or refused, the tower ``mm_vision_tower`` names, the projector from the weights or
the pretrain stage's ``mm_projector.bin``, and no vocabulary row for ``<image>`` (LLaVA's softmax)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

from neva.checkpoint.llava_original import LLAVA_MODEL_TYPES, import_llava_original, split_llava_config
from neva.checkpoint.neva_format import iter_tensors, load_config, load_metadata, load_tokenizer
from neva.convert import main as convert_main
from neva.hf_local import LocalModelError
from tests.checkpoint.tiny_llava_original import TEXT, llava_config, make_llava_original, make_tower
from tests.hf_oracle import VISION_KW


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_original")
    tower = make_tower(root / "clip")
    state = make_llava_original(root / "llava", tower)
    pretrain = make_llava_original(root / "pretrain", tower, seed=5, pretrain_only=True)
    return root, state, pretrain


def quiet_import(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_llava_original(*args, **kwargs)


def test_llava_llama_directory_imports_with_llava_vocabulary(llava_dirs, tmp_path):
    root, state, _ = llava_dirs
    out = root / "cli_ckpt"
    convert_main(["hf-to-neva", "--hf", str(root / "llava"), "--conv-template", "vicuna_v1", "--out", str(out)])
    cfg, meta, tok = load_config(out), load_metadata(out), load_tokenizer(out)
    assert (cfg.llm.vocab_size, cfg.llm.hidden_size, cfg.llm.num_layers) == (TEXT["vocab_size"], 64, 3)
    assert cfg.image_token_id == cfg.llm.vocab_size == tok.convert_tokens_to_ids("<image>")  # no row
    assert tok.pad_token == tok.unk_token  # train.py: tokenizer.pad_token = tokenizer.unk_token
    assert (cfg.projector.type, cfg.vision.vision_select_layer, cfg.vision.vision_select_feature) == (
        "mlp2x_gelu", -2, "patch")  # fmt: skip
    assert cfg.vision.image_size == VISION_KW["image_size"] and cfg.num_image_tokens == 16
    assert {k: meta[k] for k in ("tokenization", "image_aspect_ratio", "conv_template")} == {
        "tokenization": "llava", "image_aspect_ratio": "pad", "conv_template": "vicuna_v1"}  # fmt: skip
    ours = dict(iter_tensors(out))
    torch.testing.assert_close(ours["llm.tok_embeddings.weight"], state["model.embed_tokens.weight"], rtol=0, atol=0)
    torch.testing.assert_close(ours["llm.output.weight"], state["lm_head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(ours["projector.2.bias"], state["model.mm_projector.2.bias"], rtol=0, atol=0)
    tower = load_file(str(root / "clip" / "model.safetensors"))
    key = "vision_model.encoder.layers.1.mlp.fc1.weight"
    assert any(torch.equal(t, tower[key]) for k, t in ours.items() if k.startswith("vision."))


def test_pretrain_stage_output_takes_mm_projector_bin_and_the_decoder_dir(llava_dirs, tmp_path):
    root, _, pretrain = llava_dirs
    with pytest.raises(ValueError, match="--llm"):
        quiet_import(root / "pretrain", tmp_path / "no_llm")
    out = quiet_import(root / "pretrain", tmp_path / "ckpt", llm=root / "pretrain_llm")
    ours = dict(iter_tensors(out))
    for i in (0, 2):
        torch.testing.assert_close(ours[f"projector.{i}.weight"], pretrain[f"model.mm_projector.{i}.weight"])
    torch.testing.assert_close(ours["llm.output.weight"], pretrain["lm_head.weight"])
    assert load_metadata(out)["source"]["llm"] == str(root / "pretrain_llm")


def with_config(root, tmp_path, **changes):
    d = tmp_path / "variant"
    shutil.copytree(root / "llava", d)
    config = {**json.loads((d / "config.json").read_text()), **changes}
    (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v != "DROP"}))
    return d


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(mm_use_im_start_end=True), "mm_use_im_start_end"),
        (dict(image_aspect_ratio="anyres"), "image_aspect_ratio"),
        (dict(mm_patch_merge_type="spatial_unpad"), "mm_patch_merge_type"),
        (dict(mm_projector_type="resampler"), "mm_projector_type"),
        (dict(mm_hidden_size=48), "mm_hidden_size"),
        (dict(mm_new_feature=1), "mm_new_feature"),
    ],
)
def test_settings_neva_cannot_reproduce_are_refused_by_key(llava_dirs, tmp_path, changes, match):
    root, _, _ = llava_dirs
    with pytest.raises(ValueError, match=match):
        quiet_import(with_config(root, tmp_path, **changes), tmp_path / "ckpt")


def test_hub_tower_id_is_refused_with_the_local_fix(llava_dirs, tmp_path, monkeypatch):
    root, _, _ = llava_dirs
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    src = with_config(root, tmp_path, mm_vision_tower="openai/clip-vit-large-patch14-336")
    with pytest.raises(LocalModelError, match="--vision"):
        quiet_import(src, tmp_path / "ckpt")
    out = quiet_import(src, tmp_path / "ckpt", vision=root / "clip")  # the fix the message names
    assert load_metadata(out)["source"]["vision"] == str(root / "clip")


@pytest.mark.parametrize("model_type, family", sorted(LLAVA_MODEL_TYPES.items()))
def test_llava_next_model_types_hand_their_decoder_family_the_text_config(tmp_path, model_type, family):
    config = {**llava_config(tmp_path), "model_type": model_type}
    text, mm = split_llava_config(config, tmp_path)
    assert text["model_type"] == family and text["hidden_size"] == TEXT["hidden_size"]
    assert not any(k.startswith("mm_") for k in text) and mm["mm_projector_type"] == "mlp2x_gelu"


def test_export_to_llava_hf_serves_whole_prompt_ids(llava_dirs, tmp_path):
    """The llava-hf export of a LLaVA-original import: one mean ``<image>`` row is appended (llava-hf embeds
    ``image_token_index``); transformers' processor tokenizes the prompt once, so its ids are neva's ``neva``
    convention: one token fewer after each image than the checkpoint's trained (``llava``) ids, which
    ``neva.generate`` serves."""
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from neva.checkpoint.hf_export import export_llava
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig

    root, state, _ = llava_dirs
    src = quiet_import(root / "llava", tmp_path / "ckpt", metadata={"conv_template": "vicuna_v1"})
    with pytest.warns(UserWarning, match="tokenization=llava"):
        out = export_llava(src, tmp_path / "hf")
    model = LlavaForConditionalGeneration.from_pretrained(out)
    head = model.lm_head.weight.detach()
    assert head.shape[0] == TEXT["vocab_size"] + 1 == model.config.image_token_index + 1
    torch.testing.assert_close(head[:-1], state["lm_head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(head[-1], state["lm_head.weight"].mean(0), rtol=1e-6, atol=1e-7)

    image = Image.new("RGB", (40, 30), (200, 30, 30))
    answerer = Answerer(src, GenerationConfig(max_new_tokens=1))
    trained, *_ = answerer.prepare(("What is it?", [image]))
    assert isinstance(answerer.answer([("What is it?", [image])])[0], str)  # generates without an <image> row
    processor = AutoProcessor.from_pretrained(out)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        add_generation_prompt=True,
    )
    served = processor(images=[image], text=prompt, return_tensors="pt").input_ids[0].tolist()
    image_id = model.config.image_token_index
    after = len(served) - served[::-1].index(image_id)  # first position after the image
    assert trained[:after] == served[:after] and trained[after + 1 :] == served[after:]
    assert load_tokenizer(src).convert_ids_to_tokens(trained[after]) == "▁"  # the dummy prefix LLaVA trained on
