"""The online RL stage learns, seeded: a tiny model pretrained and finetuned briefly on the synthetic shapes (so that
it half knows the colour questions: it often answers with another kind of word) raises its held-out reward on the
built-in verifiable colour questions clearly within a few GRPO steps. The held-out reward is the stage's own
``val_reward``: one completion per held-out prompt, sampled as the rollouts sample, with seeds fixed per prompt, so
the same draws measure the policy before (a first step at learning rate 0) and after."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from neva.config import compose_config
from neva.data import synthetic
from neva.data.synthetic_grpo import grpo_record
from neva.training.run import run

pytestmark = pytest.mark.slow

LEAN = ["+model.mm_cfg.llm.arch_overrides.num_layers=2", "exp_manager.create_tensorboard_logger=false",
        "trainer.enable_progress_bar=false", "trainer.val_check_interval=1000"]  # fmt: skip


def colour_questions(root: Path, split: str, n: int) -> Path:
    """The built-in verifiable set's colour question of each of the first ``n`` scenes of ``split``, with its
    image, as LLaVA-style prompt records."""
    images = synthetic.SyntheticImages(0, 32)
    with open(root / f"{split}.jsonl", "w") as f:
        for i in range(n):
            scene = synthetic.scene(0, split, i)
            record = {**grpo_record(0, split, i), "problem": scene.question("color"), "answer": scene.answer("color")}
            (root / record["image"]).parent.mkdir(parents=True, exist_ok=True)
            images(record["image"]).save(root / record["image"])
            f.write(json.dumps(record) + "\n")
    return root / f"{split}.jsonl"


def held_out_rewards(exp_dir: Path) -> list[float]:
    with open(exp_dir / "metrics.csv") as f:
        return [float(r["val_reward"]) for r in csv.DictReader(f) if r.get("val_reward")]


def test_grpo_raises_the_held_out_reward_on_colour_questions(tmp_path):
    torch.set_num_threads(1)
    root = tmp_path / "data"
    root.mkdir()
    train, val = colour_questions(root, "train", 96), colour_questions(root, "val", 32)
    pretrain = run(compose_config(["+stage=pretrain", *LEAN, f"exp_manager.exp_dir={tmp_path}/pretrain",
                                   "trainer.max_steps=60", "model.data.synthetic_train_samples=960"]))  # fmt: skip
    finetune = run(compose_config(["+stage=finetune", *LEAN, f"exp_manager.exp_dir={tmp_path}/finetune",
                                   f"model.restore_from_path={pretrain}", "trainer.max_steps=40",
                                   "model.data.synthetic_train_samples=640"]))  # fmt: skip
    grpo = ["+stage=grpo", *LEAN, f"model.restore_from_path={finetune}", f"model.data.data_path={train}",
            f"model.data.validation_data_path={val}", f"model.data.image_folder={root}",
            "model.micro_batch_size=8", "model.global_batch_size=8", "model.grpo.num_generations=8",
            "model.grpo.max_new_tokens=4", "model.grpo.beta=0.02", "model.optim.lr=5e-5"]  # fmt: skip
    run(compose_config([*grpo, f"exp_manager.exp_dir={tmp_path}/before", "trainer.max_steps=1",
                        "trainer.val_check_interval=1", "model.optim.lr=0.0"]))  # fmt: skip
    run(compose_config([*grpo, f"exp_manager.exp_dir={tmp_path}/after", "trainer.max_steps=12",
                        "trainer.val_check_interval=6"]))  # fmt: skip
    (before,) = held_out_rewards(tmp_path / "before")
    after = held_out_rewards(tmp_path / "after")
    print(f"\nheld-out reward: {before:.3f} before, {after} after 6 and 12 steps")
    assert before < 0.5 and after[-1] >= before + 0.3, (before, after)
