"""Any step checkpoint of a run converts and serves: a one-process ``.ckpt`` file or a DCP directory, LoRA merged,
the architecture and tokenizer found from the config the checkpoint records."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from neva.checkpoint.neva_format import iter_tensors
from neva.checkpoint.step import materialize
from neva.convert import main as convert_main
from neva.inference import Answerer
from neva.models.generation import GenerationConfig
from neva.training.run import run
from tests.checkpoint.tiny_hf import one_thread

EVERY_STEP = ["trainer.max_steps=2", "exp_manager.checkpoint_callback_params.every_n_train_steps=1"]


def tensors(directory) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(directory))


def assert_same(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_step_checkpoints_convert_like_final_lora_included(lean_cfg, tmp_path):
    with one_thread():
        pretrain = run(lean_cfg(*EVERY_STEP))
        finetune = run(lean_cfg(*EVERY_STEP, f"model.restore_from_path={pretrain}", "model.peft.peft_scheme=lora",
                                "model.optim.lr=1e-2", stage="finetune"))  # fmt: skip
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
    """A distributed run (torchrun, 2 gloo ranks, TP2) writes DCP directories; its step checkpoint is gathered in one
    process into the weights the run's own `final` export consolidated."""
    import os
    import subprocess
    import sys

    from tests.training.conftest import LEAN

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "neva.train",
           "+stage=pretrain", *LEAN, *EVERY_STEP, f"exp_manager.exp_dir={tmp_path}/run", "model.global_batch_size=8",
           "model.micro_batch_size=4", "model.tensor_model_parallel_size=2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_dir()
    convert_main(["neva-to-neva", "--ckpt", str(last), "--out", str(tmp_path / "last")])
    assert_same(tensors(tmp_path / "last"), tensors(tmp_path / "run" / "final"))
