"""HF ↔ neva conversion: llava-hf round trip (bit-identical), legacy layouts, Llama + CLIP assembly."""

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from neva.checkpoint.hf_assemble import import_llm_and_vision, load_hf_weights, prepare_tokenizer
from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.neva_format import iter_tensors, load_config, load_model, load_tokenizer
from neva.constants import IMAGE_TOKEN
from neva.models.media import image_media
from neva.models.neva import NevaModel
from tests.checkpoint.tiny_hf import SP_VOCAB, make_clip_dir, make_llama_dir, make_llava_dir
from tests.hf_oracle import neva_from_hf

LEGACY = {  # llava-1.5-7b-hf as first published (transformers 4.3x): CLIP wrapped in vision_model, .bin shards
    "model.language_model.": "language_model.model.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "lm_head.": "language_model.lm_head.",
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    model, tokenizer = make_llava_dir(root / "hf")
    return root, model, tokenizer


def pixels_and_ids(tokenizer, model):
    n = model.config.image_seq_length
    ids = tokenizer("USER: " + IMAGE_TOKEN * n + "\nWhat is in the image? ASSISTANT:", return_tensors="pt").input_ids
    return torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0)), ids


def test_llava_round_trip_is_bit_identical_and_loads_in_transformers(llava):
    root, hf, tokenizer = llava
    ckpt = import_llava(root / "hf", root / "ckpt", max_shard_bytes=200_000)
    assert load_config(ckpt).image_token_id == hf.config.image_token_index == SP_VOCAB + 1
    assert load_tokenizer(ckpt).get_vocab()[IMAGE_TOKEN] == SP_VOCAB + 1
    out = export_llava(ckpt, root / "hf2")

    reloaded, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    sd, sd2 = hf.state_dict(), reloaded.state_dict()
    assert sd.keys() == sd2.keys()
    for key in sd:
        assert sd[key].dtype == sd2[key].dtype and torch.equal(sd[key], sd2[key]), key
    # the exported file uses the legacy layout of llava-hf's hub checkpoints (transformers 4.x and 5.x read it)
    assert "language_model.model.embed_tokens.weight" in load_file(out / "model.safetensors")

    pixels, ids = pixels_and_ids(tokenizer, hf)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels).logits
        assert torch.equal(reloaded.eval()(input_ids=ids, pixel_values=pixels).logits, expected)
        got = load_model(ckpt)(ids, image_media(pixels))
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5

    processor = AutoProcessor.from_pretrained(out)
    text = "USER: <image>\nWhat is in the image? ASSISTANT:"
    assert torch.equal(processor(images=[Image.new("RGB", (40, 30))], text=text, return_tensors="pt").input_ids, ids)
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == tokenizer(text).input_ids
    assert json.loads((out / "config.json").read_text())["image_token_index"] == SP_VOCAB + 1

    # our own export imports back to the same tensors
    again = import_llava(out, root / "ckpt2")
    first = dict(iter_tensors(ckpt))
    for key, tensor in iter_tensors(again):
        assert torch.equal(tensor, first.pop(key)), key
    assert not first


def test_legacy_sharded_bin_layout_imports(llava):
    root, hf, _ = llava
    legacy = root / "legacy"
    legacy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        (legacy / name).write_bytes((root / "hf" / name).read_bytes())
    state = {}
    for key, value in hf.state_dict().items():
        prefix = next(p for p in LEGACY if key.startswith(p))
        state[LEGACY[prefix] + key[len(prefix) :]] = value
    keys = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    weight_map = {}
    for name, shard_keys in shards.items():
        torch.save({k: state[k] for k in shard_keys}, legacy / name)
        weight_map.update(dict.fromkeys(shard_keys, name))
    (legacy / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))

    ckpt = import_llava(legacy, root / "legacy_ckpt")
    expected = neva_from_hf(hf).state_dict()
    for key, tensor in iter_tensors(ckpt):
        assert torch.equal(tensor, expected.pop(key)), key
    assert not expected
    model = load_model(ckpt)
    pixels, ids = pixels_and_ids(AutoTokenizer.from_pretrained(legacy), hf)
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixels).logits
        got = model(ids, image_media(pixels))
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_unknown_hf_tensor_is_an_error(llava, tmp_path):
    root, hf, _ = llava
    (tmp_path / "config.json").write_bytes((root / "hf" / "config.json").read_bytes())
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for extra, message in (
        ("model.language_model.layers.0.self_attn.rope_gate.weight", "no neva counterpart"),
        ("model.language_model.layers.0.self_attn.q_norm.weight", "the config's model does not have"),  # Qwen3's
    ):
        torch.save({**state, extra: torch.ones(12)}, tmp_path / "pytorch_model.bin")
        with pytest.raises(ValueError, match=message):
            import_llava(tmp_path, tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()


def test_llm_plus_clip_import_grows_tokenizer_and_embeddings(tmp_path):
    llama, llama_tok = make_llama_dir(tmp_path / "llama")
    clip = make_clip_dir(tmp_path / "clip")
    assert llama_tok.pad_token is None and IMAGE_TOKEN not in llama_tok.get_vocab()
    ckpt = import_llm_and_vision(tmp_path / "llama", tmp_path / "clip", tmp_path / "ckpt", vision_select_layer=-1)

    cfg = load_config(ckpt)
    tokenizer = load_tokenizer(ckpt)
    assert len(tokenizer) == cfg.llm.vocab_size == SP_VOCAB + 2
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == cfg.image_token_id == SP_VOCAB
    assert tokenizer.pad_token_id == SP_VOCAB + 1
    assert IMAGE_TOKEN in tokenizer.all_special_tokens
    text = "USER: <image>\nhi there"
    assert tokenizer(text).input_ids.count(cfg.image_token_id) == 1
    assert cfg.vision.vision_select_layer == -1 and cfg.projector.type == "mlp2x_gelu"

    model = load_model(ckpt)
    emb, old = model.llm.tok_embeddings.weight, llama.model.embed_tokens.weight
    assert torch.equal(emb[:SP_VOCAB], old)
    assert torch.allclose(emb[SP_VOCAB:], old.mean(0).expand(2, -1))
    assert torch.allclose(model.llm.output.weight[SP_VOCAB:], llama.lm_head.weight.mean(0).expand(2, -1))
    vision = clip.vision_model.state_dict()
    assert torch.equal(model.vision.patch_embed.weight, vision["embeddings.patch_embedding.weight"])
    assert torch.equal(model.vision.layers["2"].attn.o_proj.bias, vision["encoder.layers.2.self_attn.out_proj.bias"])

    ids = llama_tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = llama(input_ids=ids).logits
        got = model(ids)[..., :SP_VOCAB]
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
    # the training path loads the same HF weights into a freshly initialised model
    fresh = NevaModel(cfg)
    fresh.init_weights()
    load_hf_weights(fresh, tmp_path / "llama", tmp_path / "clip")
    assert len(prepare_tokenizer(tmp_path / "llama")) == len(tokenizer)
    imported = model.state_dict()
    for key, value in fresh.state_dict().items():
        if not key.startswith("projector."):
            assert torch.equal(value, imported[key]), key
    # the projector is seeded: importing again gives the same weights
    again = load_model(import_llm_and_vision(tmp_path / "llama", tmp_path / "clip", tmp_path / "ckpt2"))
    assert torch.equal(again.projector[0].weight, model.projector[0].weight)
