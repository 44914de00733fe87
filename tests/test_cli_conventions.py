"""Hydra / Lightning conventions as users meet them, in real processes: ``--help`` everywhere, a NeMo key refused
with its reason, tab completion through the console script, the progress bar to ``max_steps``, TensorBoard at
``metrics.csv``'s steps with the resolved config as hyperparameters."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.conftest import LEAN

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}


def test_every_cli_answers_help_and_nemo_keys_are_explained():
    procs = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for name, cmd in {
            "train": [sys.executable, "-m", "neva.train", "--help"],
            "plan": [sys.executable, "-m", "neva.plan", "--help"],
            "fp8": [sys.executable, "-m", "neva.train", "+stage=pretrain", "model.fp8=true"],
        }.items()
    }
    out = {name: (p.communicate(timeout=300), p.returncode) for name, p in procs.items()}
    (stdout, _), rc = out["train"]
    assert rc == 0 and "== Config ==" in stdout and "trainer" in stdout
    (stdout, _), rc = out["plan"]
    assert rc == 0 and "plan.text_tokens" in stdout
    (_, stderr), rc = out["fp8"]
    assert rc == 2 and "model.fp8=true is not supported: FP8 training is not implemented" in stderr
    assert "+model.fp8" not in stderr  # not Hydra's "use +key"
    from neva import convert, evaluate, generate, plot

    for module in (generate, evaluate, convert, plot):
        with pytest.raises(SystemExit) as exit_:
            module.main(["--help"])
        assert exit_.value.code == 0, module.__name__


def test_tab_completion_through_the_console_script(tmp_path):
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', section, re.M))  # no tomllib on Python 3.10
    assert {"neva-train", "neva-generate", "neva-evaluate", "neva-convert", "neva-plan", "neva-plot"} <= set(scripts)
    module, func = scripts["neva-train"].split(":")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "neva-train"  # what pip writes for the entry point
    exe.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    exe.chmod(0o755)
    script = """
eval "$(neva-train -sc install=bash)"
COMP_LINE="neva-train trainer.max_st"; COMP_POINT=${#COMP_LINE}; COMP_CWORD=1
hydra_bash_completion
printf '%s\\n' "${COMPREPLY[@]}"
"""
    env = {**ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.split() == ["trainer.max_steps="], out.stderr


def test_progress_bar_tensorboard_steps_and_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    overrides = [
        *LEAN,  # 120 samples = 3 steps of 32 per epoch: 4 steps cross an epoch boundary
        "exp_manager.create_tensorboard_logger=true",
        "trainer.enable_progress_bar=true",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "trainer.accumulate_grad_batches=1",  # NeMo keys through the real command line
        "model.mcore_gpt=true",
        f"exp_manager.exp_dir={tmp_path}",
    ]
    cmd = [sys.executable, "-m", "neva.train", "+stage=pretrain", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model.mcore_gpt=true has no effect in neva" in out.stderr
    bar = [line for line in out.stdout.replace("\r", "\n").splitlines() if line.startswith("Epoch ")]
    assert bar and all("/4 [" in line for line in bar), bar  # one total: the run's max_steps, not an epoch's
    assert "4/4 [" in bar[-1] and bar[-1].startswith("Epoch 1")

    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    csv_steps = {k: [int(r["step"]) for r in rows if r.get(k)] for k in ("train_loss", "val_loss")}
    assert csv_steps == {"train_loss": [1, 2, 3, 4], "val_loss": [2, 4]}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key, steps in csv_steps.items():
        assert [e.step for e in events.Scalars(key)] == steps
        assert [e.value for e in events.Scalars(key)] == pytest.approx([float(r[key]) for r in rows if r.get(key)])
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["trainer.max_steps"].number_value == 4
    assert hparams["stage"].string_value == "pretrain"
    assert hparams["model.data.conv_template"].string_value == "plain"
