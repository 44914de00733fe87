"""Mixtral HF ↔ neva: llava-hf with a Mixtral text config (per-expert and transformers-5 stacked layouts) and a
standalone Mixtral LLM + CLIP, each against transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlavaForConditionalGeneration, MixtralConfig, MixtralForCausalLM

from neva.checkpoint.hf_assemble import import_llm_and_vision
from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.neva_format import iter_tensors, load_config, load_model
from neva.models.media import image_media
from tests.checkpoint.tiny_hf import SP_VOCAB, make_clip_dir, make_tokenizer, processor_for
from tests.models.tiny_mixtral import MIXTRAL_KW, tiny_mixtral_llava


def rel_err(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def mixtral_llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral_llava")
    tokenizer = make_tokenizer(root / "_sp")
    model = tiny_mixtral_llava(seed=5, vocab_size=SP_VOCAB + 2, pad_token_id=SP_VOCAB)
    model.save_pretrained(str(root / "hf"))
    processor_for(model, tokenizer).save_pretrained(str(root / "hf"))
    return root, model, tokenizer


def test_llava_mixtral_imports_exports_and_reloads_in_transformers(mixtral_llava):
    root, hf, _ = mixtral_llava
    # transformers 5 writes the per-expert layout of the hub checkpoints
    assert "language_model.model.layers.0.block_sparse_moe.experts.3.w2.weight" in load_file(
        root / "hf" / "model.safetensors"
    )
    ckpt = import_llava(root / "hf", root / "ckpt")
    cfg = load_config(ckpt)
    assert (cfg.llm.num_moe_experts, cfg.llm.moe_router_topk) == (4, 2)
    out = export_llava(ckpt, root / "hf2")
    exported = load_file(out / "model.safetensors")
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in exported
    assert json.loads((out / "config.json").read_text())["text_config"]["model_type"] == "mixtral"

    reloaded, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    sd, sd2 = hf.state_dict(), reloaded.state_dict()
    assert sd.keys() == sd2.keys()
    for key in sd:
        assert torch.equal(sd[key], sd2[key]), key

    ids = torch.tensor([[1, 5, 9] + [hf.config.image_token_index] * hf.config.image_seq_length + [7, 8, 30, 2]])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels).logits
        assert torch.equal(reloaded.eval()(input_ids=ids, pixel_values=pixels).logits, expected)
        got = load_model(ckpt)(ids, image_media(pixels))
    assert rel_err(got, expected) < 1e-5

    # transformers 5's in-memory (stacked) layout, as a directory, imports to the same tensors
    stacked = root / "stacked"
    stacked.mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(stacked / "model.safetensors"))
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in load_file(stacked / "model.safetensors")
    (stacked / "config.json").write_text((root / "hf" / "config.json").read_text())
    first = dict(iter_tensors(ckpt))
    for key, tensor in iter_tensors(import_llava(stacked, root / "ckpt_stacked")):
        assert torch.equal(tensor, first.pop(key)), key
    assert not first


def test_standalone_mixtral_plus_clip_imports(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "_sp", vision_tokens=False)
    torch.manual_seed(1)
    mixtral = MixtralForCausalLM(MixtralConfig(**{**MIXTRAL_KW, "vocab_size": SP_VOCAB})).eval()
    mixtral.save_pretrained(str(tmp_path / "mixtral"))
    tokenizer.save_pretrained(str(tmp_path / "mixtral"))
    make_clip_dir(tmp_path / "clip")
    ckpt = import_llm_and_vision(tmp_path / "mixtral", tmp_path / "clip", tmp_path / "ckpt")
    model = load_model(ckpt)
    assert model.cfg.llm.num_moe_experts == MIXTRAL_KW["num_local_experts"]
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = mixtral(input_ids=ids).logits
        got = model(ids)[..., :SP_VOCAB]
    assert rel_err(got, expected) < 1e-5
