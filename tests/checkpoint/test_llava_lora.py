"""LLaVA's released LoRA layout (``llava-v1.5-7b-lora``: ``adapter_config.json``, ``adapter_model.bin``,
``non_lora_trainables.bin``, LLaVA's ``config.json``, and a ``model_base``) imports merged, as LLaVA's
``load_pretrained_model`` merges it: the result equals the import of a full LLaVA checkpoint whose decoder weights
are ``W + (lora_alpha / r) · B @ A`` computed here, and whose projector is the non-LoRA one."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from neva.checkpoint.llava_original import import_llava_original
from neva.checkpoint.neva_format import iter_tensors, load_metadata, load_tokenizer
from neva.convert import main as convert_main
from neva.typed import ConfigError
from tests.checkpoint.tiny_llava_original import llava_config, make_llava_original, make_tower

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # LLaVA's linear layers


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory):
    """The base (``<root>/pre_llm``: plain HF Llama + tokenizer), the LoRA directory in LLaVA's layout, and the full
    LLaVA checkpoint the merge should equal (``merged``)."""
    root = tmp_path_factory.mktemp("llava_lora")
    tower = make_tower(root / "clip")
    make_llava_original(root / "pre", tower, seed=5, pretrain_only=True, user_pieces=("USER",))
    base = root / "pre_llm"
    weights = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    adapter, merged = {}, dict(weights)
    for key, w in weights.items():
        if key.startswith("model.layers.") and key.split(".")[-2] in TARGETS:
            a = torch.randn(RANK, w.shape[1], generator=gen) * 0.1
            b = torch.randn(w.shape[0], RANK, generator=gen) * 0.1
            module = key.removesuffix(".weight")
            adapter[f"base_model.model.{module}.lora_A.weight"] = a
            adapter[f"base_model.model.{module}.lora_B.weight"] = b
            merged[key] = w.float() + (ALPHA / RANK) * (b @ a)  # the merge, computed directly
    hidden, feature = weights["model.embed_tokens.weight"].shape[1], 32
    projector = {"model.mm_projector.0.weight": torch.randn(hidden, feature, generator=gen),
                 "model.mm_projector.0.bias": torch.randn(hidden, generator=gen),
                 "model.mm_projector.2.weight": torch.randn(hidden, hidden, generator=gen),
                 "model.mm_projector.2.bias": torch.randn(hidden, generator=gen)}  # fmt: skip

    lora = root / "llava-v1.5-lora"
    lora.mkdir()
    (lora / "config.json").write_text(json.dumps(llava_config(tower)))
    adapter_config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.05, "bias": "none",
                      "target_modules": list(TARGETS), "task_type": "CAUSAL_LM", "fan_in_fan_out": False,
                      "base_model_name_or_path": str(base), "modules_to_save": None}  # fmt: skip
    (lora / "adapter_config.json").write_text(json.dumps(adapter_config))
    torch.save(adapter, lora / "adapter_model.bin")
    # What LLaVA's train.py saves: named_parameters of the PEFT model (base_model.model.model.mm_projector.*)
    torch.save({f"base_model.model.{k}": v for k, v in projector.items()}, lora / "non_lora_trainables.bin")

    full = root / "merged"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(llava_config(tower)))
    save_file({**merged, **projector}, str(full / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(base / name, full / name)
    return root, base, lora, full


def test_lora_checkpoint_imports_merged_as_llava_loads_it(lora_dirs, tmp_path):
    _, base, lora, full = lora_dirs
    convert_main(["hf-to-neva", "--hf", str(lora), "--base", str(base), "--conv-template", "vicuna_v1",
                  "--out", str(tmp_path / "from_lora")])  # fmt: skip
    expected = dict(iter_tensors(quiet(import_llava_original, full, tmp_path / "from_full")))
    got = dict(iter_tensors(tmp_path / "from_lora"))
    assert set(got) == set(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    meta = load_metadata(tmp_path / "from_lora")
    assert meta["source"]["kind"] == "llava-original-lora" and meta["source"]["lora_rank"] == RANK
    # model_base's tokenizer, read with its own rules (a user-defined piece stays whole)
    tok = load_tokenizer(tmp_path / "from_lora")
    assert tok.convert_ids_to_tokens(tok(" USER:", add_special_tokens=False)["input_ids"]) == ["▁", "▁", "USER", ":"]


def test_lora_checkpoint_without_base_or_with_a_foreign_adapter_is_refused(lora_dirs, tmp_path):
    _, base, lora, _ = lora_dirs
    with pytest.raises(ConfigError, match="model_base"):
        quiet(import_llava_original, lora, tmp_path / "a")
    bad = tmp_path / "dora"
    shutil.copytree(lora, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConfigError, match="use_dora"):
        quiet(import_llava_original, bad, tmp_path / "b", base=base)
