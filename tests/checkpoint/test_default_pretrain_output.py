"""A finetune without ``model.restore_from_path`` starts from ``<root>/pretrain/final`` beside its own
``exp_manager.exp_dir``: a pretrain and a finetune given one root find each other, and a finetune that would start
from nothing there does not fall back silently on the default root's pretrain output (one line names both)."""

from __future__ import annotations

import shutil

import pytest

from neva.checkpoint.source import default_start, resolve_source
from neva.config import compose_config
from neva.typed import ConfigError


def finetune(exp_dir=None):
    return compose_config(["+stage=finetune"] + ([f"exp_manager.exp_dir={exp_dir}"] if exp_dir else []))


def test_default_is_outputs_pretrain_final(monkeypatch):
    monkeypatch.delenv("NEVA_OUTPUT_ROOT", raising=False)
    assert default_start(finetune()) == "outputs/pretrain/final"


def test_default_follows_the_finetunes_exp_dir_root(tmp_path, tiny_checkpoint):
    shutil.copytree(tiny_checkpoint, tmp_path / "runs" / "pretrain" / "final")  # exp_manager.exp_dir=runs/pretrain
    cfg = finetune(tmp_path / "runs" / "finetune")
    assert default_start(cfg) == str(tmp_path / "runs" / "pretrain" / "final")
    assert resolve_source(cfg).checkpoint == str(tmp_path / "runs" / "pretrain" / "final")


def test_missing_start_beside_exp_dir_names_both_paths(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("NEVA_OUTPUT_ROOT", str(tmp_path / "default_root"))
    shutil.copytree(tiny_checkpoint, tmp_path / "default_root" / "pretrain" / "final")  # an older default pretrain
    with pytest.raises(ConfigError) as err:
        resolve_source(finetune(tmp_path / "runs" / "finetune"))
    message = str(err.value)
    assert "\n" not in message
    assert str(tmp_path / "runs" / "pretrain" / "final") in message
    assert f"model.restore_from_path={tmp_path / 'default_root' / 'pretrain' / 'final'}" in message


def test_missing_start_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("NEVA_OUTPUT_ROOT", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"finetune needs a pretrained model and none was found at .*runs/pretrain"):
        resolve_source(finetune(tmp_path / "runs" / "finetune"))
