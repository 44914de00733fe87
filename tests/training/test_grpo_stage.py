"""``python -m neva.train +stage=grpo`` from a checkpoint, end to end on the tiny default and the built-in verifiable
prompts: rollouts inside the run, rewards, the update, metrics, the rollouts' files and the held-out reward; exact
resume of the sampled completions; the settings the stage refuses."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from neva.checkpoint import neva_format
from neva.config import compose_config
from neva.data.synthetic import build_tokenizer
from neva.errors import ConfigError
from neva.training.grpo import check_grpo_config
from neva.training.run import run


def text_length(prompt: str, completion: str, record: dict) -> float:
    """A reward every completion of a random model gets a different value of (so that advantages are not 0)."""
    return len(completion) / 10


def grpo_cfg(tmp_path: Path, checkpoint: Path, *extra: str):
    return compose_config([
        "+stage=grpo", f"model.restore_from_path={checkpoint}", f"exp_manager.exp_dir={tmp_path}/grpo",
        "trainer.max_steps=2", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
        "trainer.val_check_interval=1", "trainer.limit_val_batches=1", "trainer.accelerator=cpu",
        "exp_manager.create_tensorboard_logger=false", "model.micro_batch_size=2", "model.global_batch_size=2",
        "model.data.synthetic_train_samples=8", "model.data.synthetic_val_samples=2", "model.data.pad_to_multiple_of=8",
        "model.grpo.num_generations=3", "model.grpo.max_new_tokens=4", "model.optim.lr=1e-3",
        "model.grpo.rewards=[{function: accuracy, weight: 0.9}, {function: format, weight: 0.1},"
        " {function: 'tests.training.test_grpo_stage:text_length', weight: 1.0}]",
        *extra,
    ])  # fmt: skip


def test_grpo_stage_trains_from_a_checkpoint(tmp_path, tiny_checkpoint, capsys):
    torch.set_num_threads(1)
    cfg = grpo_cfg(tmp_path, tiny_checkpoint, "model.grpo.beta=0.04", "model.grpo.num_iterations=2",
                   "trainer.enable_progress_bar=true")  # fmt: skip
    final = run(cfg)
    assert neva_format.is_neva_checkpoint(final)
    bar = capsys.readouterr().out
    assert "reward=" in bar and "kl=" in bar, bar[-2000:]
    exp = Path(cfg.exp_manager.exp_dir)
    with open(exp / "metrics.csv") as f:
        every = list(csv.DictReader(f))
    rows = [r for r in every if r.get("train_loss")]
    # μ = 2 updates per rollout batch: Lightning's step counts updates
    assert [int(r["step"]) for r in rows] == [2]
    for key in (
        "reward",
        "rewards/accuracy/mean",
        "rewards/format/std",
        "kl",
        "clip_fraction",
        "entropy",
        "completion_length",
        "completion_truncated",
        "rollout_time",
        "update_time",
        "frac_reward_zero_std",
    ):
        assert key in rows[0], key
    lines = [json.loads(x) for x in (exp / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 3
    assert set(lines[0]) >= {"prompt_id", "completion", "completion_ids", "rewards", "advantage"}
    image_id = build_tokenizer().convert_tokens_to_ids("<image>")  # suppressed: no image features for a completion
    assert all(image_id not in line["completion_ids"] for line in lines)
    assert float(rows[0]["advantage_abs_mean"]) > 0 and float(rows[0]["kl"]) > 0  # the 2nd update left the reference
    (held_out,) = [r for r in every if r.get("val_reward")]
    assert "val_rewards/accuracy/mean" in held_out


def test_resume_draws_the_same_completions(tmp_path, tiny_checkpoint):
    """Sampling is seeded per (step, prompt, j): a run stopped after step 1 and resumed writes step 2's rollouts as
    the uninterrupted run does (the data sampler's position rides in the checkpoint)."""
    torch.set_num_threads(1)
    every = "exp_manager.checkpoint_callback_params.every_n_train_steps=1"
    dynamic = "model.grpo.dynamic_sampling=true"  # DAPO: all-equal groups left out of the update (runs the path)
    whole = grpo_cfg(tmp_path / "a", tiny_checkpoint, every, dynamic, "trainer.val_check_interval=100")
    run(whole)
    first = grpo_cfg(
        tmp_path / "b", tiny_checkpoint, every, dynamic, "trainer.val_check_interval=100", "trainer.max_steps=1"
    )
    run(first)
    run(grpo_cfg(tmp_path / "b", tiny_checkpoint, every, dynamic, "trainer.val_check_interval=100"))
    read = lambda cfg: (Path(cfg.exp_manager.exp_dir) / "rollouts" / "step_2.jsonl").read_text()  # noqa: E731
    assert read(first) == read(whole)


@pytest.mark.parametrize("extra,key", [
    (["model.data.packing=true"], r"model\.data\.packing"),
    (["model.loss_normalization=micro_batch_mean"], r"model\.loss_normalization"),
])  # fmt: skip
def test_refused_settings_name_their_key(tmp_path, tiny_checkpoint, extra, key):
    with pytest.raises(ConfigError, match=key):
        check_grpo_config(grpo_cfg(tmp_path, tiny_checkpoint, *extra))


def test_generation_under_sequence_parallelism_refuses_linear_attention():
    """Sequence parallelism pads each generating forward after its real positions (``LayoutGenerationModel``): a
    linear-attention layer's recurrent state would take the padding in, so such a model is refused (a start-time rule
    of a stage that rolls out: ``check_run``, ``tests/parallel/test_run_rules.py``)."""
    from types import SimpleNamespace

    from neva.parallel.generation_model import check_generation_layout
    from neva.parallel.layout import Layout

    def cfg(linear: object) -> SimpleNamespace:
        return SimpleNamespace(llm=SimpleNamespace(linear_attention=linear))

    check_generation_layout(cfg(object()), Layout(tp=2, sp=False))
    check_generation_layout(cfg(None), Layout(tp=2, sp=True))
    with pytest.raises(ConfigError, match=r"model\.sequence_parallel=false"):
        check_generation_layout(cfg(object()), Layout(tp=2, sp=True))
