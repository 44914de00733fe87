"""Any step checkpoint of a run converts and serves: a one-process ``.ckpt`` file or a DCP directory, LoRA merged,
the architecture and tokenizer found from the config and the start the checkpoint records; the last step of a run
always has one."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from safetensors.torch import load_file

from neva.checkpoint import verified
from neva.checkpoint.neva_format import iter_tensors
from neva.checkpoint.step import materialize
from neva.config import compose_config
from neva.convert import main as convert_main
from neva.inference import Answerer
from neva.models.generation import GenerationConfig
from neva.training.run import run
from neva.typed import ConfigError
from tests.checkpoint.tiny_hf import one_thread
from tests.training.conftest import LEAN

EVERY_STEP = ["trainer.max_steps=2", "exp_manager.checkpoint_callback_params.every_n_train_steps=1"]
EVERY_TWO_OF_THREE = ["trainer.max_steps=3", "exp_manager.checkpoint_callback_params.every_n_train_steps=2"]


def tensors(directory) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(directory))


def assert_same(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A two-step pretrain with a checkpoint at every step, and a three-step LoRA finetune from it with one every two
    steps, both run in their own directory with relative exp_dirs (the finetune's start: the default one beside its
    exp_dir, ``rel/pretrain/final``): the tests read them from another directory."""
    root = tmp_path_factory.mktemp("runs")

    def cfg(stage, *overrides):
        return compose_config([f"+stage={stage}", *LEAN, f"exp_manager.exp_dir=rel/{stage}", *overrides])

    with one_thread(), contextlib.chdir(root):
        pretrain = root / run(cfg("pretrain", *EVERY_STEP))
        lora = ["model.peft.peft_scheme=lora", "model.optim.lr=1e-2"]
        finetune = root / run(cfg("finetune", *lora, *EVERY_TWO_OF_THREE))
    return pretrain, finetune


def test_last_step_has_a_checkpoint_off_the_interval(runs):
    """Three steps, a checkpoint every two: step=3.ckpt is written and last.ckpt holds step 3 (`final`'s step)."""
    _, finetune = runs
    checkpoints = finetune.parent / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step=*.ckpt")) == ["step=2.ckpt", "step=3.ckpt"]
    assert verified.verify(checkpoints / "last.ckpt") == 3


def test_step_checkpoint_refuses_a_start_that_moved_or_changed(runs, tmp_path):
    """The finetune's step checkpoints record their start (absolute path, sha256): gone, or with other files, the
    conversion stops with one line naming it instead of merging onto other weights."""
    pretrain, finetune = runs
    step = finetune.parent / "checkpoints" / "step=2.ckpt"
    moved = pretrain.with_name("moved")
    pretrain.rename(moved)
    try:
        with pytest.raises(ConfigError, match="holds no neva checkpoint now"):
            materialize(step, tmp_path / "a")
        shutil.copytree(moved, pretrain)
        (pretrain / "config.json").write_text((pretrain / "config.json").read_text() + "\n")
        with pytest.raises(ConfigError, match="changed since"):
            materialize(step, tmp_path / "b")
    finally:
        shutil.rmtree(pretrain, ignore_errors=True)
        moved.rename(pretrain)


def test_step_checkpoints_convert_like_final_lora_included(runs, tmp_path):
    pretrain, finetune = runs
    # The last step's checkpoint holds the weights `final` was written from; an earlier step's differ.
    checkpoints = pretrain.parent / "checkpoints"
    assert_same(tensors(materialize(checkpoints / "step=2.ckpt", tmp_path / "p2")), tensors(pretrain))
    step1 = tensors(materialize(checkpoints / "step=1.ckpt", tmp_path / "p1"))
    assert not torch.equal(step1["projector.0.weight"], tensors(pretrain)["projector.0.weight"])

    # LoRA: merged as the end-of-stage export merges it, through `neva.convert` (to neva and to HF).
    last = finetune.parent / "checkpoints" / "last.ckpt"
    convert_main(["neva-to-neva", "--ckpt", str(last), "--out", str(tmp_path / "ft")])
    assert_same(tensors(tmp_path / "ft"), tensors(finetune))
    convert_main(["neva-to-hf", "--ckpt", str(last), "--out", str(tmp_path / "ft_hf")])
    convert_main(["neva-to-hf", "--ckpt", str(finetune), "--out", str(tmp_path / "final_hf")])
    assert_same(
        load_file(tmp_path / "ft_hf" / "model.safetensors"), load_file(tmp_path / "final_hf" / "model.safetensors")
    )

    # Serving the step checkpoint answers what `final` answers (greedy).
    from PIL import Image

    items = [("<image>\nWhat shape is this?", [Image.new("RGB", (40, 30), "red")]), ("Say something.", [])]
    decoding = GenerationConfig(max_new_tokens=8)
    with one_thread():
        assert Answerer(last, decoding).answer(items) == Answerer(finetune, decoding).answer(items)


@pytest.mark.slow
def test_dcp_step_checkpoint_of_two_ranks_converts_like_final(tmp_path):
    """A distributed run (torchrun's environment, 2 gloo ranks, TP2) writes DCP directories; its step checkpoint is
    gathered in one process into the weights the run's own `final` export consolidated."""
    import os

    from tests.parallel.harness import neva_train

    argv = ["+stage=pretrain", *LEAN, *EVERY_STEP, f"exp_manager.exp_dir={tmp_path}/run", "model.global_batch_size=8",
            "model.micro_batch_size=4", "model.tensor_model_parallel_size=2"]  # fmt: skip
    proc = neva_train(argv, 2, {**os.environ, "OMP_NUM_THREADS": "1"})  # torchrun --nproc_per_node 2 -m neva.train
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_dir()
    convert_main(["neva-to-neva", "--ckpt", str(last), "--out", str(tmp_path / "last")])
    assert_same(tensors(tmp_path / "last"), tensors(tmp_path / "run" / "final"))


def test_lora_exports_as_a_peft_adapter_that_peft_applies(runs, tmp_path):
    """`--peft-adapter`: PEFT applies the adapter to the exported base (and, through `modules_to_save`, to the export
    of the checkpoint the run started from); merged, both give the logits of neva's merged export."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    pretrain, finetune = runs
    last = finetune.parent / "checkpoints" / "last.ckpt"
    convert_main(["neva-to-hf", "--ckpt", str(last), "--out", str(tmp_path / "base"),
                  "--peft-adapter", str(tmp_path / "adapter")])  # fmt: skip
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("self_attn.q_proj.lora_A.weight") and k.startswith("base_model.model.") for k in adapter)
    convert_main(["neva-to-hf", "--ckpt", str(finetune), "--out", str(tmp_path / "merged")])
    convert_main(["neva-to-hf", "--ckpt", str(pretrain), "--out", str(tmp_path / "start")])

    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    inputs = processor(images=Image.new("RGB", (40, 30), "red"), text="<image>\nWhat is it?", return_tensors="pt")

    def logits(model):
        with torch.no_grad():
            return model.eval()(**inputs).logits

    with one_thread():
        expected = logits(LlavaForConditionalGeneration.from_pretrained(tmp_path / "merged"))
        for base in ("base", "start"):
            model = LlavaForConditionalGeneration.from_pretrained(tmp_path / base)
            with_adapter = peft.PeftModel.from_pretrained(model, tmp_path / "adapter")
            torch.testing.assert_close(logits(with_adapter), expected, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(logits(with_adapter.merge_and_unload()), expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(logits(LlavaForConditionalGeneration.from_pretrained(tmp_path / "base")), expected)


def test_lora_step_exports_in_llava_lora_layout(runs, tmp_path):
    """``neva-to-llava --lora-base``: LLaVA's LoRA layout (adapter, non_lora_trainables.bin) and its model_base;
    LLaVA's merge of them (neva's LoRA import, as load_pretrained_model merges) is the run's own `final`."""
    import warnings

    from neva.checkpoint.llava_original import import_llava_original

    _, finetune = runs
    last = finetune.parent / "checkpoints" / "last.ckpt"
    convert_main(["neva-to-llava", "--ckpt", str(last), "--lora-base", str(tmp_path / "base"),
                  "--out", str(tmp_path / "lora")])  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "lora").iterdir())
    assert names == ["adapter_config.json", "adapter_model.bin", "config.json", "non_lora_trainables.bin",
                     "vision_tower"]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = import_llava_original(tmp_path / "lora", tmp_path / "merged", base=tmp_path / "base")
    got, expected = tensors(merged), tensors(finetune)
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.slow
def test_llava_load_pretrained_model_merges_the_lora_export(runs, tmp_path):
    """LLaVA's own loader (llava-torch 1.2.2.post1 side environment) on ``neva-to-llava --lora-base``'s output:
    ``load_pretrained_model(lora, base, "llava-...-lora")`` merges it into the run's `final` (logits)."""
    import json
    import os
    import subprocess
    import sys

    from neva.checkpoint.neva_format import load_config, load_model
    from neva.models.media import image_media
    from tests.checkpoint.test_llava_export import LLAVA_DRIVER
    from tests.pip_site import cached_site
    from tests.training.test_llava_trainer import LLAVA_IMAGE, LLAVA_PINS

    _, finetune = runs
    last = finetune.parent / "checkpoints" / "last.ckpt"
    convert_main(["neva-to-llava", "--ckpt", str(last), "--lora-base", str(tmp_path / "base"), "--out",
                  str(tmp_path / "llava-lora")])  # fmt: skip
    cfg = load_config(finetune)
    pixels = torch.randn(1, 3, cfg.vision.image_size, cfg.vision.image_size, generator=torch.Generator().manual_seed(0))
    torch.save(pixels, tmp_path / "pixels.pt")
    driver = LLAVA_DRIVER.replace('load_pretrained_model(path, None, "llava-neva-export"',
                                  'load_pretrained_model(path, sys.argv[6], "llava-neva-export-lora"')  # fmt: skip
    site = cached_site("llava-torch-1.2.2.post1", LLAVA_PINS)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", driver, str(tmp_path / "llava-lora"), json.dumps([1, 5, LLAVA_IMAGE, 7, 9]), "hi",
           str(tmp_path / "pixels.pt"), str(tmp_path / "logits.pt"), str(tmp_path / "base")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, encoding="utf-8", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ids = torch.tensor([[1, 5, *[cfg.image_token_id] * cfg.num_image_tokens, 7, 9]])
    with torch.no_grad():
        ours = load_model(finetune, dtype=torch.float32).eval()(ids, image_media(pixels))
    llava = torch.load(tmp_path / "logits.pt")
    assert llava.shape == ours.shape
    # LLaVA loads in fp16 (builder.py casts every model): the tolerance is fp16's
    torch.testing.assert_close(llava, ours, rtol=2e-2, atol=2e-2)
    print(f"\nLLaVA LoRA load_pretrained_model vs neva final: max abs diff {(llava - ours).abs().max().item():.2e}")
