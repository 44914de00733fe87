"""Every entry point turns a bad input into one line naming the key, file or value, exit status 2, no traceback
(``neva.errors``); ``--debug`` shows the traceback, and a bug keeps it.

One real process per entry point proves the process-level behaviour; the rest of each list runs in-process through the
same decorated ``main`` / ``cli``."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Dinov2Config, LlamaConfig, LlavaConfig, Qwen3VLConfig

from neva import convert, evaluate, generate, plan
from neva.data import preview
from neva.errors import DEBUG_ENV, ConfigError, entry_point, exit_on_input_error, one_line
from tests.checkpoint.tiny_hf import one_thread

ENV = {k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "HYDRA_FULL_ERROR")} | {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_checkpoint) -> Path:
    """The tiny neva checkpoint (``ckpt``), and bad inputs made from it: its weights not safetensors (``corrupt``), its
    config.json not JSON (``notjson``), an empty directory, an HF llava directory whose vision tower is a kind neva has
    none for (DINOv2), and a LLaVA-original one with an ``mm_*`` key neva does not know."""
    root = tmp_path_factory.mktemp("bad")
    for name in ("ckpt", "corrupt", "notjson"):
        shutil.copytree(tiny_checkpoint, root / name)
    for weights in (root / "corrupt").glob("*.safetensors"):
        weights.write_bytes(b"not safetensors" * 4)
    (root / "notjson" / "config.json").write_text("{format: neva")
    (root / "empty").mkdir()
    text = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    vision = Dinov2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    LlavaConfig(vision_config=vision, text_config=text).save_pretrained(root / "dinov2-llava")
    # a Qwen3-VL config whose M-RoPE section does not split its decoder's 8 rotary frequencies
    from tests.fixtures.tiny_qwen_vl import TEXT_OF, VISION

    text = dict(
        TEXT_OF["qwen3_vl"], rope_parameters={**TEXT_OF["qwen3_vl"]["rope_parameters"], "mrope_section": [4, 4, 4]}
    )
    vision = dict(VISION["qwen3_vl"], patch_size=16, spatial_merge_size=2)
    Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=404).save_pretrained(root / "qwen3-vl-mrope")
    (root / "llava-original").mkdir()
    (root / "llava-original" / "config.json").write_text('{"model_type": "llava_llama", "mm_bogus": 1}')
    return root


GEN = "--prompt hi --device cpu --checkpoint"
PREVIEW = "--conv-template plain --data-path"
BATCH = "--checkpoint {root}/ckpt --input-file {root}/no.jsonl"
CORRUPT = "{root}/corrupt/model.safetensors"
# (case, entry point, its command line with {root} for the fixture's folder, what the one line must name)
REFUSED = [
    ("generate: missing checkpoint", generate.main, f"{GEN} {{root}}/nope", ["{root}/nope"]),
    ("generate: not a checkpoint", generate.main, f"{GEN} {{root}}/empty", ["{root}/empty", "config.json"]),
    ("generate: corrupt safetensors", generate.main, f"{GEN} {{root}}/corrupt", [CORRUPT]),
    ("generate: config.json not JSON", generate.main, f"{GEN} {{root}}/notjson", ["{root}/notjson/config.json"]),
    ("generate: unknown template", generate.main, f"{GEN} {{root}}/ckpt --template vicuna_v9", ["'vicuna_v9'"]),
    ("generate: missing image", generate.main, f"{GEN} {{root}}/ckpt --image {{root}}/no.png", ["{root}/no.png"]),
    ("generate: missing input file", generate.main, f"{BATCH} --device cpu", ["{root}/no.jsonl"]),
    ("evaluate: missing checkpoint", evaluate.main, "--checkpoint {root}/nope", ["--checkpoint", "{root}/nope"]),
    ("evaluate: corrupt safetensors", evaluate.main, "--checkpoint {root}/corrupt", [CORRUPT]),
    ("evaluate: missing input file", evaluate.main, f"{BATCH} --output-file {{root}}/a.jsonl", ["{root}/no.jsonl"]),
    ("evaluate: no output file", evaluate.main, BATCH, ["--input-file", "--output-file"]),
    ("convert: unknown tower kind", convert.main, "hf-to-neva --hf {root}/dinov2-llava", ["model_type='dinov2'"]),
    ("convert: unknown LLaVA mm_ key", convert.main, "hf-to-neva --hf {root}/llava-original", ["mm_bogus=1"]),
    ("convert: missing HF directory", convert.main, "hf-to-neva --hf {root}/nope", ["{root}/nope"]),
    ("convert: HF dir without config", convert.main, "hf-to-neva --hf {root}/empty", ["{root}/empty", "model_type"]),
    ("convert: export of a non-checkpoint", convert.main, "neva-to-hf --ckpt {root}/empty", ["{root}/empty"]),
    ("convert: corrupt safetensors", convert.main, "neva-to-hf --conv-template plain --ckpt {root}/corrupt", [CORRUPT]),
    ("convert: not a step checkpoint", convert.main, "neva-to-neva --ckpt {root}/ckpt", ["--ckpt {root}/ckpt"]),
    # one round trip (issue 52): the closest valid key at once, not Hydra's "use +key" that neva would refuse next
    (
        "plan: misspelled override",
        plan.cli,
        "+stage=pretrain model.optim.lrr=0.1",
        ["model.optim.lrr", "did you mean lr"],
    ),
    ("plan: unknown planner option", plan.cli, "+stage=pretrain plan.bogus=1", ["plan.bogus"]),
    ("plan: bad planner value", plan.cli, "+stage=pretrain plan.text_tokens=abc", ["plan.text_tokens=abc"]),
    # Qwen-VL's keys (issue 52): a section neva's M-RoPE refuses; a pixel budget whose other end is the tower's default
    (
        "convert: Qwen-VL mrope_section",
        convert.main,
        "hf-to-neva --hf {root}/qwen3-vl-mrope",
        ["mrope_section", "[4, 4, 4]"],
    ),
    (
        "plan: Qwen-VL max_pixels alone",
        plan.cli,
        "+stage=pretrain cluster=dgx_h100 trainer.devices=1 model=tiny_qwen2_5_vl vision=tiny_qwen2_5_vl "
        "+model.data.max_pixels=200",
        ["max_pixels=200", "model.data.min_pixels"],
    ),
    ("plan: bad config value", plan.cli, "+stage=pretrain trainer.devices=3", ["model.global_batch_size=32"]),
    ("preview: missing data", preview.main, f"{PREVIEW} {{root}}/no.json --tokenizer synthetic", ["{root}/no.json"]),
    ("preview: missing tokenizer", preview.main, f"{PREVIEW} synthetic --tokenizer {{root}}/nope", ["{root}/nope"]),
    ("preview: tokenizer not JSON", preview.main, f"{PREVIEW} synthetic --tokenizer {{root}}/notjson", ["notjson"]),
    (
        "preview: --video-fps, no videos",
        preview.main,
        f"{PREVIEW} synthetic --tokenizer synthetic --video-fps 2",
        ["--video-fps", "--video-folder"],
    ),
]
OUT = {convert.main: " --out {root}/out"}  # every conversion names an output: none may appear


def the_one_line(err: str, names: list[str]) -> str:
    """``err``'s only non-empty line, checked to be an error naming every one of ``names``."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(("error: ", "config error: ")), err
    assert all(name in lines[0] for name in names), (names, err)
    return lines[0]


@pytest.fixture
def _restore_grad_mode():
    """``neva.evaluate`` turns autograd off for its whole process; the tests that follow in this one need it."""
    yield
    torch.set_grad_enabled(True)


@one_thread()
@pytest.mark.usefixtures("_restore_grad_mode")
@pytest.mark.parametrize(("case", "main", "command", "names"), REFUSED, ids=[r[0] for r in REFUSED])
def test_bad_input_is_one_line_and_exit_2(case, main, command, names, bad, capsys):
    with pytest.raises(SystemExit) as exited:
        main((command + OUT.get(main, "")).format(root=bad).split())
    assert exited.value.code == 2, case
    the_one_line(capsys.readouterr().err, [n.format(root=bad) for n in names])
    assert not (bad / "out").exists()  # nothing written for a refused conversion


def test_each_entry_point_process_exits_2_with_one_line(bad):
    """The console processes themselves (torch imported, Hydra's own reporting for train and plan); ``--debug``
    gives the traceback instead."""
    run = [sys.executable, "-m"]
    procs = {
        "train": ([*run, "neva.train", "+stage=pretrain", "model.optim.lrr=0.1", f"exp_manager.exp_dir={bad}/exp"],
                  ["model.optim.lrr", "did you mean lr"]),
        "plan": ([*run, "neva.plan", "+stage=pretrain", "plan.text_tokens=abc"], ["plan.text_tokens=abc"]),
        "convert": ([*run, "neva.convert", "hf-to-neva", "--hf", f"{bad}/dinov2-llava", "--out", f"{bad}/out"],
                    ["model_type='dinov2'"]),
        "generate": ([*run, "neva.generate", "--checkpoint", f"{bad}/corrupt", "--prompt", "hi", "--device", "cpu"],
                     [f"{bad}/corrupt/model.safetensors"]),
        "evaluate": ([*run, "neva.evaluate", "--checkpoint", f"{bad}/nope"], [f"{bad}/nope"]),
        "data.preview": ([*run, "neva.data.preview", "--data-path", f"{bad}/nope.json", "--conv-template", "plain",
                          "--tokenizer", "synthetic"], [f"{bad}/nope.json"]),
        "plan --debug": ([*run, "neva.plan", "+stage=pretrain", "plan.text_tokens=abc", "--debug"], []),
    }  # fmt: skip
    started = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for name, (cmd, _) in procs.items()
    }
    for name, proc in started.items():
        _, err = proc.communicate(timeout=300)
        if name == "plan --debug":
            assert proc.returncode == 1 and "Traceback" in err, err
            assert err.strip().splitlines()[-1] == "neva.errors.ConfigError: plan.text_tokens=abc: expected an integer"
            continue
        assert proc.returncode == 2, (name, err)
        the_one_line(err, procs[name][1])
    assert not (bad / "exp").exists() and not (bad / "out").exists()


def test_debug_raises_and_a_bug_keeps_its_traceback(monkeypatch):
    @entry_point
    def main(argv):
        if argv == ["bug"]:
            return {}["key"]  # a KeyError of the code, not of the input
        raise ConfigError("model.optim.lr: 'x' is not a float")

    with pytest.raises(ConfigError):
        main(["--debug"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ConfigError):
        main([])
    monkeypatch.delenv(DEBUG_ENV)
    with pytest.raises(KeyError):
        main(["bug"])
    with pytest.raises(FileNotFoundError), exit_on_input_error():
        raise FileNotFoundError("a path of neva's own code is not the user's")  # no filename: not a user path


def test_a_message_of_several_lines_prints_as_one():
    assert one_line("Could not override 'model.lrr'.\nTo append use +model.lrr=1") == (
        "Could not override 'model.lrr'. To append use +model.lrr=1"
    )
    assert one_line("these changes alter what is trained:\n  a: 1 → 2\n  b: 3 → 4\nResume with") == (
        "these changes alter what is trained: a: 1 → 2; b: 3 → 4; Resume with"
    )
