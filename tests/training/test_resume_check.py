"""The config a checkpoint records against a resumed run's: what stops the resume, what is applied and logged."""

import dataclasses
import io
import json
import logging

import pytest
import torch

from neva.config import TrainConfig
from neva.training.resume_check import APPLIED, CONFIG_KEY, check_resume, config_record
from neva.typed import ConfigError


def _leaf_keys(cfg, path=""):
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_keys(value, f"{path}{f.name}.")
        else:
            yield f"{path}{f.name}"


def _checkpoint(cfg) -> dict:
    return {CONFIG_KEY: config_record(cfg), "global_step": 6}


def test_the_record_is_plain_data_and_every_applied_entry_names_config_keys():
    record = config_record(TrainConfig())
    buf = io.BytesIO()
    torch.save({CONFIG_KEY: record}, buf)
    buf.seek(0)
    assert json.loads(torch.load(buf, weights_only=True)[CONFIG_KEY])["model"]["seed"] == 1234
    keys = list(_leaf_keys(TrainConfig()))
    for entry in APPLIED:  # a misspelled entry would silently refuse the key it meant
        assert any(k == entry or (entry.endswith(".") and k.startswith(entry)) for k in keys), entry


def test_changes_that_alter_what_is_trained_stop_the_resume_naming_each(lean_cfg, tmp_path):
    saved = lean_cfg()
    data = tmp_path / "other.json"
    data.write_text("[]")
    changed = lean_cfg(
        "model.global_batch_size=16",
        "model.seed=7",
        f"model.data.data_path={data}",
        "model.data.conv_template=vicuna_v1",
        "+model.mm_cfg.llm.arch_overrides.hidden_size=128",
        "model.peft.peft_scheme=lora",
        "trainer.max_steps=500",
        "model.optim.lr=1e-4",
    )
    with pytest.raises(ConfigError) as err:
        check_resume(_checkpoint(saved), changed, "ckpt/last.ckpt")
    text = str(err.value)
    for line in (
        "model.global_batch_size: 32 → 16",
        "model.seed: 1234 → 7",
        f'model.data.data_path: "synthetic" → "{data}"',
        'model.data.conv_template: "plain" → "vicuna_v1"',
        'model.mm_cfg.llm.arch_overrides: {"num_layers": 2} → {"hidden_size": 128, "num_layers": 2}',
        'model.peft.peft_scheme: "none" → "lora"',
        "exp_manager.resume_ignore_config_changes=true",
    ):
        assert line in text, text
    assert "max_steps" not in text and "model.optim.lr" not in text  # applied, not refused


def test_a_pretrain_folder_resumed_as_finetune_names_the_stage(lean_cfg):
    with pytest.raises(ConfigError, match='stage: "pretrain" → "finetune"'):
        check_resume(_checkpoint(lean_cfg()), lean_cfg("model.restore_from_path=null", stage="finetune"), "last.ckpt")


def test_safe_changes_are_applied_and_logged_one_line_per_key(lean_cfg, caplog):
    changed = lean_cfg(
        "trainer.max_steps=500",
        "model.optim.lr=1e-4",
        "model.optim.sched.warmup_steps=3",
        "trainer.precision=bf16-mixed",
        "model.megatron_amp_O2=true",
        "model.micro_batch_size=8",
        "model.tensor_model_parallel_size=2",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=7",
        "trainer.log_every_n_steps=3",
    )
    with caplog.at_level(logging.INFO, logger="neva.training.resume_check"):
        check_resume(_checkpoint(lean_cfg()), changed, "last.ckpt")
    lines = [r.getMessage() for r in caplog.records]
    expected = [
        "trainer.max_steps: 150 → 500",
        "model.optim.lr: 0.002 → 0.0001",
        "model.optim.sched.warmup_steps: null → 3",
        'trainer.precision: "32" → "bf16-mixed"',
        "model.megatron_amp_O2: false → true",
        "model.micro_batch_size: 16 → 8",
        "model.tensor_model_parallel_size: 1 → 2",
        "exp_manager.checkpoint_callback_params.every_n_train_steps: 50 → 7",
        "trainer.log_every_n_steps: 10 → 3",
    ]
    assert len(lines) == len(expected), lines
    for change in expected:
        assert sum(change in line and "at step 6" in line and "applied" in line for line in lines) == 1, (change, lines)


def test_the_opt_in_key_accepts_the_changes_with_a_warning_each(lean_cfg, caplog):
    changed = lean_cfg("model.seed=7", "exp_manager.resume_ignore_config_changes=true")
    with caplog.at_level(logging.INFO, logger="neva.training.resume_check"):
        check_resume(_checkpoint(lean_cfg()), changed, "last.ckpt")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "model.seed: 1234 → 7" in warned[0] and "resume_ignore_config_changes" in warned[0]


def test_older_checkpoints_are_resumed_with_a_warning(lean_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="neva.training.resume_check"):
        check_resume({"global_step": 3}, lean_cfg("model.seed=7"), "old.ckpt")
    assert "old.ckpt records no config" in caplog.text
    # A key the writer did not have yet is not a change.
    saved = json.loads(config_record(lean_cfg()))
    del saved["model"]["data"]["num_workers"], saved["model"]["seed"]
    check_resume({CONFIG_KEY: json.dumps(saved)}, lean_cfg("model.seed=7"), "older.ckpt")


def test_a_finished_run_refuses_changed_training_settings_unless_training_continues(lean_cfg):
    """Resuming a run that reached max_steps with another learning rate would train nothing under it and rewrite its
    final checkpoint: refused. Raising max_steps continues the training, and the new rate is applied."""
    saved = lean_cfg("trainer.max_steps=6")
    with pytest.raises(ConfigError, match=r"belongs to a finished run \(checkpoint at step 6, trainer.max_steps=6"):
        check_resume(_checkpoint(saved), lean_cfg("trainer.max_steps=6", "model.optim.lr=1e-4"), "last.ckpt")
    check_resume(_checkpoint(saved), lean_cfg("trainer.max_steps=12", "model.optim.lr=1e-4"), "last.ckpt")
    check_resume(_checkpoint(saved), lean_cfg("trainer.max_steps=6", "trainer.devices=2"), "last.ckpt")  # runtime
    accepted = lean_cfg("trainer.max_steps=6", "model.optim.lr=1e-4", "exp_manager.resume_ignore_config_changes=true")
    check_resume(_checkpoint(saved), accepted, "last.ckpt")
