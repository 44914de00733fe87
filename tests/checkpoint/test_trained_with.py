"""A later stage takes what its starting checkpoint was trained with (``neva.checkpoint.trained_with``): the template,
system prompt and pixel budget a Qwen-VL finetune recorded reach the DPO stage without being given again; a key the
run sets wins and is named; a pretrain's ``plain`` template is never taken over."""

from __future__ import annotations

import json
import logging

import pytest
from hydra import compose, initialize_config_dir

from neva.checkpoint.trained_with import given_data_keys, inherit_trained_with
from neva.config import CONFIG_DIR, to_train_config
from neva.nemo_keys import rewrite_overrides


def fake_checkpoint(path, **metadata):
    """A neva checkpoint's config.json: all the settings reader looks at."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"format": "neva", "version": 1, "model": {}, **metadata}))
    return path


def resolved(overrides):
    """``neva.train``'s config for these overrides, completed from its start as ``neva.train`` completes it."""
    overrides = rewrite_overrides(overrides)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        dcfg = compose("neva", overrides=overrides)
    return inherit_trained_with(to_train_config(dcfg, overrides), given_data_keys(dcfg, overrides))


QWEN = dict(stage="finetune", conv_template="qwen2_vl", system_prompt="Be brief.", min_pixels=784, max_pixels=9408)


def test_dpo_takes_the_finetunes_template_and_budget(tmp_path, caplog):
    ckpt = fake_checkpoint(tmp_path / "ft", **QWEN)
    with caplog.at_level(logging.INFO, logger="neva.train"):
        data = resolved(["+stage=dpo", f"model.restore_from_path={ckpt}"]).model.data
    assert (data.conv_template, data.system_prompt, data.min_pixels, data.max_pixels) == (
        "qwen2_vl", "Be brief.", 784, 9408,
    )  # fmt: skip
    assert f"from {ckpt} (what it was trained with): model.data.conv_template='qwen2_vl'" in caplog.text


def test_the_runs_own_keys_win_and_are_named(tmp_path, caplog):
    ckpt = fake_checkpoint(tmp_path / "ft", **QWEN)
    with caplog.at_level(logging.INFO, logger="neva.train"):
        data = resolved(
            ["+stage=dpo", f"model.restore_from_path={ckpt}", "model.data.conv_template=chatml",
             "model.data.max_pixels=3136"]
        ).model.data  # fmt: skip
    # its own template, so the template's default system prompt (not the finetune's); the budget's other end taken
    assert (data.conv_template, data.system_prompt, data.min_pixels, data.max_pixels) == ("chatml", None, 784, 3136)
    assert "model.data.conv_template='chatml' (trained: 'qwen2_vl')" in caplog.text
    assert "model.data.max_pixels=3136 (trained: 9408)" in caplog.text


@pytest.mark.parametrize("override", ["model.mm_cfg.llm.model_type=chatml", "model=tiny_qwen2_5_vl"])
def test_a_template_chosen_by_model_type_is_the_runs(tmp_path, override):
    ckpt = fake_checkpoint(tmp_path / "ft", **QWEN)
    assert resolved(["+stage=dpo", f"model.restore_from_path={ckpt}", override]).model.data.conv_template == "chatml"


def test_a_pretrains_plain_template_is_not_taken(tmp_path):
    ckpt = fake_checkpoint(
        tmp_path / "pt", stage="pretrain", conv_template="plain", system_prompt=None, max_pixels=9408
    )
    data = resolved(["+stage=finetune", f"model.restore_from_path={ckpt}"]).model.data
    assert (data.conv_template, data.max_pixels) == ("vicuna_v1", 9408)


def test_a_budget_against_the_taken_one_is_one_config_error(tmp_path):
    """``model.data.max_pixels=200`` below the min_pixels taken from the checkpoint: one line naming both, exit 2
    (issue 52: a traceback, exit 1)."""
    from neva.errors import ConfigError

    ckpt = fake_checkpoint(tmp_path / "ft", **QWEN)
    with pytest.raises(ConfigError, match=r"max_pixels=200.*model\.data\.min_pixels=784 from"):
        resolved(["+stage=dpo", f"model.restore_from_path={ckpt}", "model.data.max_pixels=200"])


def test_a_restored_7b_model_gets_a_7b_recipe_not_the_tiny_ones(tmp_path, caplog):
    """Restoring a 7B-class checkpoint without choosing a recipe: LLaVA-1.5's 7B finetune recipe, said in one line
    (issue 52: the tiny recipe's lr 1e-3, silently); a key given on the command line stays; a tiny checkpoint keeps
    the tiny recipe."""
    from neva.checkpoint.architecture import neva_config_from_mm
    from neva.checkpoint.restored_recipe import restored_recipe
    from neva.config import compose_config
    from neva.models.config import to_dict

    def checkpoint(name, model_group):
        mm = compose_config(["+stage=finetune", f"model={model_group}"]).model.mm_cfg
        return fake_checkpoint(tmp_path / name, stage="finetune", model=to_dict(neva_config_from_mm(mm)))

    seven = checkpoint("qwen7b", "qwen2_7b")
    with caplog.at_level(logging.INFO, logger="neva.train"):
        overrides = ["+stage=finetune", f"model.restore_from_path={seven}", "model.micro_batch_size=2"]
        cfg = restored_recipe(resolved(overrides), overrides)
    assert (cfg.model.optim.lr, cfg.model.global_batch_size, cfg.trainer.max_epochs) == (2e-5, 128, 1)
    assert cfg.model.micro_batch_size == 2  # the command line's
    assert "closest to model=llama2_7b's" in caplog.text and "model.optim.lr=2e-05" in caplog.text
    tiny = checkpoint("tiny", "tiny")
    overrides = ["+stage=finetune", f"model.restore_from_path={tiny}"]
    assert restored_recipe(resolved(overrides), overrides).model.optim.lr == 1e-3
