"""Weights are checked before they are copied, and models come from local directories only: real files with a wrong
tensor, an index that leaves its directory, missing paths and remote code, through the commands users run."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from neva.checkpoint.hf_import import import_llava
from neva.checkpoint.hf_read import iter_hf_tensors
from neva.checkpoint.neva_format import load_model, save_checkpoint
from tests.checkpoint.tiny_hf import make_clip_dir, make_llama_dir, make_llava_dir
from tests.training.test_cli import ENV, train_cmd

# No offline switch and an endpoint nothing listens on: a call that tried the Hub would fail fast, on this machine,
# with transformers' own error instead of neva's.
ONLINE = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
ONLINE["HF_ENDPOINT"] = "http://127.0.0.1:9"


def tiny_neva(directory: Path, **kwargs) -> Path:
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.models.neva import NevaModel

    source = resolve_source(compose_config(["+stage=pretrain", "++model.mm_cfg.llm.arch_overrides={num_layers:2}"]))
    torch.manual_seed(0)
    model = NevaModel(source.cfg)
    model.init_weights()
    return save_checkpoint(directory, source.cfg, model.state_dict(), source.tokenizer, **kwargs)


def replace_tensor(file: Path, key: str, make) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rewrite safetensors ``file`` with ``key`` replaced by ``make(old)``; returns (old shape, new shape)."""
    tensors = load_file(file)
    old = tensors[key]
    tensors[key] = make(old)
    save_file(tensors, file, metadata={"format": "pt"})
    return tuple(old.shape), tuple(tensors[key].shape)


def run(cmd: list[str], env=ENV, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kwargs)


def generate(ckpt: Path) -> subprocess.CompletedProcess:
    args = ["--checkpoint", str(ckpt), "--prompt", "What is this?", "--max-new-tokens", "2", "--device", "cpu"]
    return run([sys.executable, "-m", "neva.generate", *args])


def test_generate_refuses_a_size_one_tensor_it_would_broadcast(tmp_path):
    ckpt = tiny_neva(tmp_path / "ckpt")
    assert generate(ckpt).returncode == 0  # the intact checkpoint answers
    old, new = replace_tensor(ckpt / "model.safetensors", "llm.norm.weight", lambda t: t[:1].clone())

    out = generate(ckpt)
    assert out.returncode != 0
    assert f"tensor 'llm.norm.weight' has shape {new}, the model expects {old}" in out.stderr
    assert out.stdout == ""  # no answer


def test_restore_from_path_with_a_wrong_hidden_size_stops_before_training(tmp_path):
    ckpt = tiny_neva(tmp_path / "ckpt")
    old, new = replace_tensor(ckpt / "model.safetensors", "projector.2.weight", lambda t: t[:, :-8].clone())
    exp_dir = tmp_path / "ft"

    out = run(train_cmd(exp_dir, f"model.restore_from_path={ckpt}", "trainer.max_steps=2", stage="finetune"))
    assert out.returncode != 0
    assert f"{ckpt}: tensor 'projector.2.weight' has shape {new}, the model expects {old}" in out.stderr
    assert not (exp_dir / "checkpoints").exists() and not (exp_dir / "metrics.csv").exists()
    assert not (exp_dir / "final").exists()


def test_hf_import_and_hf_start_name_the_tensor_of_the_wrong_shape(tmp_path):
    make_llava_dir(tmp_path / "llava")
    key = next(
        k for k in load_file(tmp_path / "llava" / "model.safetensors") if k.endswith("layers.0.mlp.up_proj.weight")
    )
    old, new = replace_tensor(tmp_path / "llava" / "model.safetensors", key, lambda t: t[:-1].clone())
    expected = f"tensor 'llm.layers.0.feed_forward.w3.weight' has shape {new}, the model expects {old}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        import_llava(tmp_path / "llava", tmp_path / "out")
    assert not (tmp_path / "out").exists()

    make_llama_dir(tmp_path / "llama")
    make_clip_dir(tmp_path / "clip")
    old, new = replace_tensor(tmp_path / "llama" / "model.safetensors", "model.norm.weight", lambda t: t[:1].clone())
    exp_dir = tmp_path / "pre"
    hf = [
        f"model.mm_cfg.llm.from_pretrained={tmp_path}/llama",
        f"model.mm_cfg.vision_encoder.from_pretrained={tmp_path}/clip",
    ]
    out = run(train_cmd(exp_dir, *hf, "trainer.max_steps=2"))
    assert out.returncode != 0
    assert f"tensor 'llm.norm.weight' has shape {new}, the model expects {old}" in out.stderr
    assert not (exp_dir / "checkpoints").exists()


def test_an_index_may_not_point_outside_its_directory(tmp_path):
    ckpt = tiny_neva(tmp_path / "ckpt", max_shard_bytes=200_000)
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"].values()))
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(ckpt / first, tmp_path / "elsewhere" / first)
    data["weight_map"] = {k: f"../elsewhere/{v}" if v == first else v for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"weight file '\.\./elsewhere/.*' is outside the index's directory"):
        load_model(ckpt)
    data["weight_map"] = {k: str(tmp_path / "elsewhere" / first) for k in data["weight_map"]}
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="outside the index's directory"):
        next(iter_hf_tensors(ckpt))  # the HF reader goes through the same check


def test_a_missing_local_path_fails_at_once_without_the_hub(tmp_path):
    missing = tmp_path / "no-such-model"
    start = time.monotonic()
    out = run(train_cmd(tmp_path / "run", f"model.mm_cfg.llm.from_pretrained={missing}"), env=ONLINE)
    assert out.returncode == 2
    assert f"model.mm_cfg.llm.from_pretrained: '{missing}' is not a local directory" in out.stderr
    assert "never looks a name up on the Hub" in out.stderr
    assert time.monotonic() - start < 60  # no retries against a hub
    assert not (tmp_path / "run" / "checkpoints").exists()

    out = run([sys.executable, "-m", "neva.convert", "hf-to-neva", "--hf", str(missing), "--out", str(tmp_path / "o")],
              env=ONLINE)  # fmt: skip
    assert out.returncode != 0 and f"'{missing}' is not a local directory" in out.stderr
    assert not (tmp_path / "o").exists()


def test_remote_code_is_refused_without_a_prompt(tmp_path):
    """A config whose ``auto_map`` names code shipped in the directory: transformers would ask ``[y/N]`` on stdin
    (and run it on "y"); neva refuses before anything is imported, whatever stdin holds."""
    llama = tmp_path / "llama"
    make_llama_dir(llama)
    make_clip_dir(tmp_path / "clip")
    config = json.loads((llama / "config.json").read_text())
    config.update(model_type="neva_planted", auto_map={"AutoConfig": "planted.PlantedConfig"})
    (llama / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (llama / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\n")

    hf = [f"model.mm_cfg.llm.from_pretrained={llama}", f"model.mm_cfg.vision_encoder.from_pretrained={tmp_path}/clip"]
    out = run(train_cmd(tmp_path / "run", *hf), env=ONLINE, input="y\n")
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"{llama}: loading it needs Python code shipped with the model" in out.stderr
    assert "[y/N]" not in out.stdout + out.stderr
    assert not marker.exists()
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert os.listdir(llama).count("planted.py") == 1
