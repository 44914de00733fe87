"""neva checkpoint directory: round trip, sharding, streaming input, validation, atomicity, tokenizer."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from neva.checkpoint.neva_format import (
    iter_tensors,
    load_config,
    load_metadata,
    load_model,
    load_tokenizer,
    save_checkpoint,
)
from neva.models.neva import NevaModel
from neva.models.presets import build_config
from tests.checkpoint.tiny_hf import make_tokenizer


def random_model(tie: bool = False) -> NevaModel:
    torch.manual_seed(0)
    model = NevaModel(build_config(tie_word_embeddings=tie))
    model.init_weights()
    return model.eval()


def assert_same_weights(a: NevaModel, b: NevaModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_round_trip_sharded_with_tokenizer(tmp_path):
    model = random_model()
    tokenizer = make_tokenizer(tmp_path / "tok")
    ckpt = save_checkpoint(
        tmp_path / "ckpt", model.cfg, model.state_dict(), tokenizer, max_shard_bytes=300_000, metadata={"step": 7}
    )
    files = sorted(p.name for p in ckpt.iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and shards[-1].endswith(f"of-{len(shards):05d}.safetensors")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    config = json.loads((ckpt / "config.json").read_text())
    assert (config["format"], config["version"], config["dtype"], config["step"]) == ("neva", 1, "float32", 7)
    assert load_config(ckpt) == model.cfg
    assert load_metadata(ckpt)["step"] == 7
    loaded = load_model(ckpt)
    assert_same_weights(model, loaded)
    assert torch.equal(loaded.llm.inv_freq, model.llm.inv_freq)
    ids = torch.randint(0, 400, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    for tok in (load_tokenizer(ckpt), AutoTokenizer.from_pretrained(ckpt)):
        assert tok("USER: <image>\nhi").input_ids == tokenizer("USER: <image>\nhi").input_ids


def test_streaming_iterator_tied_embeddings_and_dtype(tmp_path):
    model = random_model(tie=True)
    pairs = ((k, v.to(torch.bfloat16)) for k, v in model.state_dict().items())
    ckpt = save_checkpoint(tmp_path / "ckpt", model.cfg, pairs)
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "model.safetensors.index.json").exists()
    assert "llm.output.weight" not in dict(iter_tensors(ckpt))  # stored once, as HF does
    loaded = load_model(ckpt)
    assert next(loaded.parameters()).dtype == torch.bfloat16  # the saved dtype by default
    assert loaded.llm.inv_freq.dtype == torch.float32
    assert loaded.llm.output.weight is loaded.llm.tok_embeddings.weight
    assert torch.equal(loaded.llm.output.weight, model.llm.tok_embeddings.weight.to(torch.bfloat16))
    assert next(load_model(ckpt, dtype=torch.float32).parameters()).dtype == torch.float32


@pytest.mark.parametrize("problem", ["missing", "unknown", "shape"])
def test_invalid_weights_fail_and_leave_nothing(tmp_path, problem):
    model = random_model()
    sd = dict(model.state_dict())
    if problem == "missing":
        sd.pop("projector.0.bias")
    elif problem == "unknown":
        sd["llm.extra.weight"] = torch.zeros(2)
    else:
        sd["llm.norm.weight"] = torch.zeros(3)
    with pytest.raises((KeyError, ValueError)):
        save_checkpoint(tmp_path / "ckpt", model.cfg, sd)
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_needs_overwrite(tmp_path):
    model = random_model()
    save_checkpoint(tmp_path / "ckpt", model.cfg, model.state_dict(), metadata={"step": 1})
    with pytest.raises(FileExistsError):
        save_checkpoint(tmp_path / "ckpt", model.cfg, model.state_dict())
    save_checkpoint(tmp_path / "ckpt", model.cfg, model.state_dict(), metadata={"step": 2}, overwrite=True)
    assert load_metadata(tmp_path / "ckpt")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_not_a_neva_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match="not a neva checkpoint"):
        load_config(tmp_path)
