"""NeMo NeVA keys on neva's command line: every key of NeMo's own config files has a meaning in neva (an alias with
the same effect as neva's key, a fixed or derived value, or a refusal that says why); ``model_type`` selects the
template; settings a checkpoint overrides are named; NeMo and LLaVA paths where an LLM is expected are explained."""

import dataclasses
import logging
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from neva.checkpoint.architecture import neva_config_from_mm
from neva.checkpoint.restored_architecture import check_restore_settings
from neva.checkpoint.source import resolve_source
from neva.config import compose_config
from neva.models.config import LLMConfig, VisionConfig
from neva.nemo_keys import NEMO_KEYS, SUBTREES, Alias, Derived, Fixed, Ignored, Same, Unsupported, lookup
from neva.typed import ConfigError

HERE = Path(__file__).parent
NEMO_FILES = [HERE / "neva_config.yaml", HERE / "neva_finetune.yaml"]  # NeMo 1.x, source named in each file
NEMO_FILES.append(HERE / "neva_mixtral_config.yaml")  # NeMo 1.x's Mixtral NeVA (the MoE keys)
# Same-named keys whose schema entry lands with a parallel branch (remove once merged into main).


def leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += leaves(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


@pytest.fixture(scope="module")
def neva_keys() -> set[str]:
    from hydra import compose, initialize_config_dir

    from neva.config import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose("neva", overrides=["+stage=pretrain"])
    return set(leaves(OmegaConf.to_container(cfg)))


def test_every_key_of_nemo_neva_configs_has_an_entry(neva_keys):
    keys = {k for f in NEMO_FILES for k in leaves(yaml.safe_load(f.read_text()))}
    assert len(keys) > 170  # the files were read whole
    assert not [k for k in sorted(keys) if lookup(k) is None]
    # ... and the table says nothing about keys NeMo does not have (no stale entries)
    assert set(NEMO_KEYS) <= keys and all(any(k.startswith(p + ".") for k in keys) for p in SUBTREES)
    for key, entry in NEMO_KEYS.items():
        if isinstance(entry, Same):
            assert key in neva_keys, key
        if isinstance(entry, Alias):
            target = entry.target.lstrip("+")
            for part, cls in ((".llm.arch_overrides.", LLMConfig), (".vision_encoder.arch_overrides.", VisionConfig)):
                if part in target:
                    assert target.rpartition(".")[2] in {f.name for f in dataclasses.fields(cls)}, key
                    break
            else:
                assert target in neva_keys or target.startswith("exp_manager.wandb"), key
    doc = (HERE.parents[1] / "docs" / "NEMO.md").read_text()
    assert not [k for k in [*NEMO_KEYS, *SUBTREES] if f"`{k}" not in doc]  # docs/NEMO.md shows the whole table
    kinds = {type(e) for e in NEMO_KEYS.values()}
    assert kinds == {Same, Alias, Fixed, Derived, Ignored, Unsupported}


STAGE = ["+stage=pretrain"]


@pytest.mark.parametrize(
    ("nemo", "neva"),
    [
        (["trainer.accumulate_grad_batches=1"], []),
        (["model.data.packed_sequence=true"], ["model.data.packing=true"]),
        (["model.num_layers=3", "model.hidden_size=96"], ["++model.mm_cfg.llm.arch_overrides.num_layers=3",
                                                        "++model.mm_cfg.llm.arch_overrides.hidden_size=96"]),
        (["exp_manager.explicit_log_dir=/tmp/run"], ["exp_manager.exp_dir=/tmp/run"]),
        (["exp_manager.checkpoint_callback_params.save_top_k=5"], ["exp_manager.checkpoint_callback_params.save_top_k=5"]),
        (["model.data.global_batch_size=64", "model.data.micro_batch_size=4"],
         ["model.global_batch_size=64", "model.micro_batch_size=4"]),
        (["model.mm_cfg.vision_encoder.crop_size=[56,56]", "model.mm_cfg.vision_encoder.patch_dim=8"],
         ["++model.mm_cfg.vision_encoder.arch_overrides.image_size=56",
          "++model.mm_cfg.vision_encoder.arch_overrides.patch_size=8"]),
        (["model.seq_len_interpolation_factor=2"],
         ["++model.mm_cfg.llm.arch_overrides.rope_scaling={rope_type:linear,factor:2}"]),
        (["model.num_attention_heads=8", "model.kv_channels=16", "model.num_query_groups=2",
          "model.ffn_hidden_size=256", "model.layernorm_epsilon=1e-6", "model.share_embeddings_and_output_weights=true",
          "exp_manager.wandb_logger_kwargs.project=p"],
         ["++model.mm_cfg.llm.arch_overrides.num_heads=8", "++model.mm_cfg.llm.arch_overrides.head_dim=16",
          "++model.mm_cfg.llm.arch_overrides.num_kv_heads=2", "++model.mm_cfg.llm.arch_overrides.intermediate_size=256",
          "++model.mm_cfg.llm.arch_overrides.rms_norm_eps=1e-6",
          "++model.mm_cfg.llm.arch_overrides.tie_word_embeddings=true", "++exp_manager.wandb_logger_kwargs.project=p"]),
        (["model.encoder_seq_length=512", "model.normalization=rmsnorm", "model.mcore_gpt=true"],
         ["++model.mm_cfg.llm.arch_overrides.max_seq_len=512"]),
    ],
)  # fmt: skip
def test_alias_gives_the_same_config_as_the_neva_key(nemo, neva):
    assert compose_config(STAGE + nemo) == compose_config(STAGE + neva)


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("trainer.accumulate_grad_batches=4", "set model.global_batch_size instead"),
        ("model.fp8=true", "FP8 training is not implemented"),
        ("model.tokenizer.model=/x/tokenizer.model", "the tokenizer comes from model.mm_cfg.llm.from_pretrained"),
        ("model.energon.use_energon=true", "Energon datasets are not read"),
        ("model.max_position_embeddings=8192", "derived from model.encoder_seq_length"),
        ("exp_manager.checkpoint_callback_params.monitor=val_loss", "not the best by a metric"),
    ],
)
def test_unsupported_key_is_refused_with_the_reason(override, reason):
    with pytest.raises(ConfigError, match=reason):
        compose_config([*STAGE, override])


def test_alias_contradicting_its_target_is_refused():
    with pytest.raises(ConfigError, match=r"model\.global_batch_size to different values"):
        compose_config([*STAGE, "model.data.global_batch_size=64", "model.global_batch_size=32"])


def test_model_type_selects_the_template_as_nemo():
    ft = ["+stage=finetune"]
    assert compose_config(ft).model.data.conv_template == "vicuna_v1"  # default model_type v1
    assert compose_config([*ft, "model.mm_cfg.llm.model_type=llama_3"]).model.data.conv_template == "llama_3"
    explicit = [*ft, "model.mm_cfg.llm.model_type=llama_3", "model.data.conv_template=mistral"]
    assert compose_config(explicit).model.data.conv_template == "mistral"  # an explicit template wins
    assert compose_config(["+stage=pretrain", "model.mm_cfg.llm.model_type=llama_3"]).model.data.conv_template == (
        "plain"  # the pretrain stage sets plain, as NeMo's pretraining command does
    )
    with pytest.raises(ConfigError, match="nvgpt"):
        compose_config([*ft, "model.mm_cfg.llm.model_type=nvgpt"])


def test_settings_replaced_by_restore_from_path_are_named(caplog):
    cfg = compose_config(STAGE)
    ckpt = neva_config_from_mm(cfg.model.mm_cfg)
    mm = compose_config(
        [*STAGE, "model.mm_cfg.mm_mlp_adapter_type=linear", "model.mm_cfg.vision_encoder.vision_select_layer=-1"]
    ).model.mm_cfg
    mm.vision_encoder.from_pretrained = "/models/clip"
    mm.llm.preset = "llama2_13b"
    with caplog.at_level(logging.WARNING, logger="neva.checkpoint.source"):
        check_restore_settings(mm, ckpt, "/ckpt")
    text = caplog.text
    assert "model.mm_cfg.mm_mlp_adapter_type='linear' is ignored" in text and "'mlp2x_gelu'" in text
    assert "model.mm_cfg.vision_encoder.vision_select_layer=-1 is ignored" in text
    assert "model.mm_cfg.vision_encoder.from_pretrained='/models/clip' is ignored" in text
    assert "model.mm_cfg.llm.preset='llama2_13b' is ignored" in text and "hidden_size=128" in text
    caplog.clear()
    check_restore_settings(cfg.model.mm_cfg, ckpt, "/ckpt")  # settings equal to the checkpoint's: nothing to say
    assert not caplog.text
    layers = compose_config([*STAGE, "++model.mm_cfg.llm.arch_overrides.num_layers=7"]).model.mm_cfg
    with pytest.raises(ConfigError, match=r"arch_overrides.num_layers=7 \(the checkpoint has 4\)"):
        check_restore_settings(layers, ckpt, "/ckpt")


def test_nemo_and_llava_paths_say_what_to_do(tmp_path):
    from transformers import LlavaConfig

    nemo_file = tmp_path / "neva_7b.nemo"
    nemo_file.write_bytes(b"tar")
    extracted = tmp_path / "extracted"
    extracted.mkdir()
    (extracted / "model_config.yaml").write_text("mm_cfg: {}\n")
    cfg = compose_config(["+stage=finetune"])
    for path in (nemo_file, extracted):
        cfg.model.restore_from_path, cfg.model.mm_cfg.llm.from_pretrained = str(path), None
        with pytest.raises(ConfigError, match=r"model.restore_from_path: .* is a NeMo checkpoint .*hf-to-neva"):
            resolve_source(cfg)
        cfg.model.restore_from_path, cfg.model.mm_cfg.llm.from_pretrained = None, str(path)
        with pytest.raises(ConfigError, match=r"llm.from_pretrained: .* is a NeMo checkpoint .*convert_llama_nemo"):
            resolve_source(cfg)
    LlavaConfig().save_pretrained(tmp_path / "llava")  # a llava-hf config.json, as in llava-hf/llava-1.5-7b-hf
    cfg.model.mm_cfg.llm.from_pretrained = str(tmp_path / "llava")
    with pytest.raises(ConfigError, match=r"whole vision-language model \(model_type 'llava'\).*hf-to-neva"):
        resolve_source(cfg)


def test_nemo_keys_in_yaml_files_act_as_on_the_command_line(tmp_path):
    """A preset or a user's own config file with NeMo keys: aliases give the command line's config (a command-line
    override of the target still wins over the file), a refused key stops with the command line's message."""
    import os
    import subprocess
    import sys

    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "nemo_user.yaml").write_text(
        "# @package _global_\n"
        "model:\n  data: {packed_sequence: true}\n  num_layers: 3\n  mcore_gpt: true\n"
        "  mm_cfg: {vision_encoder: {crop_size: [56, 56]}}\n"
        "exp_manager: {explicit_log_dir: /tmp/run}\n"
    )
    search = f"hydra.searchpath=[file://{tmp_path}]"
    cli = ["model.data.packed_sequence=true", "model.num_layers=3", "model.mcore_gpt=true",
           "model.mm_cfg.vision_encoder.crop_size=[56,56]", "exp_manager.explicit_log_dir=/tmp/run"]  # fmt: skip
    assert compose_config([search, *STAGE, "+preset=nemo_user"]) == compose_config([*STAGE, *cli])
    assert not compose_config([search, *STAGE, "+preset=nemo_user", "model.data.packing=false"]).model.data.packing

    # A user's primary config (--config-dir/--config-name) through the real command line: exit 2, the same message.
    (tmp_path / "mine.yaml").write_text(
        "defaults: [neva, _self_]\nstage: pretrain\nmodel:\n  data: {packed_sequence: true}\n  fp8: true\n"
    )
    with pytest.raises(ConfigError) as refused:
        compose_config([*STAGE, "model.data.packed_sequence=true", "model.fp8=true"])
    cmd = [sys.executable, "-m", "neva.train", "--config-dir", str(tmp_path), "--config-name", "mine"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"config error: {refused.value}"
    assert "FP8 training is not implemented" in proc.stderr


def test_a_nemo_file_given_to_convert_generate_evaluate_is_one_message(tmp_path, capsys):
    """A .nemo (a tar file) where a checkpoint is expected: exit status 2 and one line naming the option, the file and
    what to do; no traceback."""
    import tarfile

    from neva.convert import main as convert_main
    from neva.evaluate import main as evaluate_main
    from neva.generate import main as generate_main

    (tmp_path / "model_config.yaml").write_text("mm_cfg: {}\n")
    nemo = tmp_path / "neva_7b.nemo"
    with tarfile.open(nemo, "w") as tar:
        tar.add(tmp_path / "model_config.yaml", arcname="model_config.yaml")
    out = str(tmp_path / "out")
    calls = [
        (convert_main, ["neva-to-hf", "--ckpt", str(nemo), "--out", out], "--ckpt"),
        (convert_main, ["neva-to-neva", "--ckpt", str(nemo), "--out", out], "--ckpt"),
        (convert_main, ["hf-to-neva", "--hf", str(nemo), "--out", out], "--hf"),
        (generate_main, ["--checkpoint", str(nemo), "--prompt", "hi"], "--checkpoint"),
        (evaluate_main, ["--checkpoint", str(nemo)], "--checkpoint"),
    ]
    for main, argv, option in calls:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"config error: {option}: {nemo} is a NeMo checkpoint (.nemo)")
        assert "convert_llava_nemo_to_hf.py" in err and "neva.convert hf-to-neva" in err
    assert not (tmp_path / "out").exists()


def test_class_token_length_and_mlp_downsample_follow_the_tower():
    """NeMo's SigLIP recipe keys: class_token_length 0 with a SigLIP tower and mlp_downsample (4 image tokens on the
    tiny tower); 0 with CLIP (or 1 with SigLIP) is refused at start naming both."""

    siglip = ["model.mm_cfg.vision_encoder.preset=tiny_siglip", "model.mm_cfg.mm_mlp_adapter_type=mlp_downsample"]
    cfg = neva_config_from_mm(
        compose_config([*STAGE, *siglip, "model.mm_cfg.vision_encoder.class_token_length=0"]).model.mm_cfg
    )
    assert (cfg.vision.kind, cfg.projector.type, cfg.num_image_tokens) == ("siglip", "mlp_downsample", 4)
    for tower, length in (("tiny", 0), ("tiny_siglip", 1)):
        mm = compose_config([*STAGE, f"model.mm_cfg.vision_encoder.preset={tower}",
                             f"model.mm_cfg.vision_encoder.class_token_length={length}"]).model.mm_cfg  # fmt: skip
        with pytest.raises(ConfigError, match=f"class_token_length={length}, but the .* tower has {1 - length}"):
            neva_config_from_mm(mm)
