"""``python -m neva.train +stage=dpo`` from a finetuned checkpoint, end to end on the tiny default and the built-in
synthetic pairs (the reference is the starting weights: the first step's sigmoid loss is log 2); the layouts and
settings the stage refuses; transformers' linear and constant schedules."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neva.checkpoint import neva_format
from neva.config import OptimConfig, SchedConfig, compose_config
from neva.errors import ConfigError
from neva.training.dpo import METRICS, check_preference_config
from neva.training.optim import build_scheduler
from neva.training.run import run


def dpo_cfg(tmp_path: Path, checkpoint: Path, *extra: str):
    return compose_config([
        "+stage=dpo", f"model.restore_from_path={checkpoint}", f"exp_manager.exp_dir={tmp_path}/dpo",
        "trainer.max_steps=2", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
        "trainer.val_check_interval=2", "trainer.accelerator=cpu", "exp_manager.create_tensorboard_logger=false",
        "model.micro_batch_size=2", "model.global_batch_size=4", "model.data.synthetic_train_samples=8",
        "model.data.synthetic_val_samples=4", "model.data.pad_to_multiple_of=8",
        "model.optim.sched.warmup_steps=0",  # HF's warmup starts at lr 0: the first step would not move the policy
        *extra,
    ])  # fmt: skip


@pytest.mark.parametrize("extra", [[], ["model.peft.peft_scheme=lora", "model.mm_cfg.freeze_projector=true"]])
def test_dpo_stage_trains_from_a_finetune_checkpoint(tmp_path, tiny_checkpoint, extra, capsys):
    torch.set_num_threads(1)
    cfg = dpo_cfg(tmp_path, tiny_checkpoint, *extra, "trainer.enable_progress_bar=true")
    final = run(cfg)
    bar = capsys.readouterr().out  # Lightning's bar writes to stdout
    assert "rewards/accuracy=" in bar and "rewards/margin=" in bar, bar[-2000:]  # the headline beside the loss
    assert neva_format.is_neva_checkpoint(final)
    with open(Path(cfg.exp_manager.exp_dir) / "metrics.csv") as f:
        every = list(csv.DictReader(f))
    rows = [r for r in every if r.get("train_loss")]
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert set(METRICS) <= set(rows[0])
    # the first step's policy is the reference: every margin 0, the sigmoid loss log 2
    assert float(rows[0]["train_loss"]) == pytest.approx(math.log(2), rel=1e-6)
    assert float(rows[0]["rewards/margin"]) == pytest.approx(0.0, abs=1e-6)
    assert float(rows[1]["train_loss"]) != pytest.approx(math.log(2), rel=1e-6)  # the policy moved
    # the validation after step 2 logs the held-out pairs' rewards too; its loss is their mean pair loss (no SFT term)
    (held_out,) = [r for r in every if r.get("val_loss")]
    assert int(held_out["step"]) == 2 and {f"val_{m}" for m in METRICS} <= set(held_out)
    assert float(held_out["val_dpo_loss"]) == pytest.approx(float(held_out["val_loss"]), rel=1e-6)
    assert float(held_out["val_rewards/margin"]) == pytest.approx(
        float(held_out["val_rewards/chosen"]) - float(held_out["val_rewards/rejected"]), abs=1e-6
    )


def test_without_a_finetuned_model_the_stage_says_what_to_run(tmp_path):
    env = {**os.environ, "NEVA_OUTPUT_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run([sys.executable, "-m", "neva.train", "+stage=dpo"], env=env, capture_output=True, text=True)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "+stage=finetune" in lines[0] and str(tmp_path / "finetune" / "final") in lines[0]


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.loss_normalization=micro_batch_mean", "model.loss_normalization"),
        ("model.peft.peft_scheme=lora", "model.mm_cfg.freeze_projector"),
        ("model.data.packing=true model.tensor_model_parallel_size=2", "model.data.packing"),
        ("model.data.max_tokens_per_micro_batch=4096", "model.data.max_tokens_per_micro_batch"),
    ],
)
def test_refused_settings_name_their_key(tmp_path, override, key):
    cfg = compose_config(["+stage=dpo", "model.restore_from_path=/nowhere", *override.split(" ")])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_preference_config(cfg)


def test_the_dpo_preset_composes():
    cfg = compose_config(["+preset=llava_next_dpo_qwen2_7b", "model.restore_from_path=/nowhere"])
    assert cfg.stage == "dpo" and cfg.model.optim.lr == 5e-7 and cfg.model.optim.sched.name == "linear"
    assert cfg.model.dpo.beta == 0.1 and cfg.model.global_batch_size == 128 and cfg.trainer.max_epochs == 3
    check_preference_config(cfg)


@pytest.mark.parametrize("name", ["linear", "constant_with_warmup"])
def test_hf_schedules(name):
    # transformers' get_linear_schedule_with_warmup / get_constant_schedule_with_warmup, written out
    warm, total = 3, 10

    def expected(s: int) -> float:
        if s < warm:
            return s / warm
        return max(0.0, (total - s) / (total - warm)) if name == "linear" else 1.0

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    opt.param_groups[0]["base_lr"] = 2.0
    sched = build_scheduler(opt, OptimConfig(lr=2.0, sched=SchedConfig(name=name, warmup_steps=warm)), total)
    for s in range(total + 1):
        assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * expected(s)), s
        opt.step()
        sched.step()


def test_video_pairs_train(tmp_path):
    """LLaVA-NeXT's DPO records with a ``video`` (LLaVA-Hound's video DPO) on a LLaVA-NeXT-Video-style model: the stage
    trains (the first step's loss log 2, then the policy moves); its batches encode each pair's frames once
    (tests/data/test_preference.py)."""
    import json

    from tests.data.video_files import write_video
    from tests.parallel.harness import FAMILIES, make_checkpoint

    torch.set_num_threads(1)
    ckpt = make_checkpoint(tmp_path / "video_ckpt", "llama_clip_video")
    pairs = tmp_path / "pairs.jsonl"
    records = []
    for i, (chosen, rejected) in enumerate([("left", "up"), ("up", "down"), ("down", "left"), ("right", "up")]):
        write_video(tmp_path / f"clip{i}.mp4", 6 + i)
        records.append({"id": f"v{i}", "video": f"clip{i}.mp4", "prompt": "<video>\nWhich way does it move?",
                        "chosen": chosen, "rejected": rejected})  # fmt: skip
    pairs.write_text("\n".join(json.dumps(r) for r in records))
    data = [f"model.data.data_path={pairs}", f"model.data.validation_data_path={pairs}", f"model.data.video_folder={tmp_path}",
            "model.data.num_frames=4", *FAMILIES["llama_clip_video"]]  # fmt: skip
    cfg = dpo_cfg(tmp_path, ckpt, *data)
    run(cfg)
    with open(Path(cfg.exp_manager.exp_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert float(rows[0]["train_loss"]) == pytest.approx(math.log(2), rel=1e-6)
    assert float(rows[1]["train_loss"]) != pytest.approx(math.log(2), rel=1e-6)
