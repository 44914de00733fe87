"""The README's "Your own models, start to finish" block, run as it is: tiny HF directories in place of /models, a
LLaVA-format set in place of /data, in a fresh directory where the quick start has run first (so a finetune that
silently took the quick start's ``outputs/pretrain/final`` would show). Only the step counts are shortened."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from neva.checkpoint import verified
from neva.checkpoint.start_record import START_KEY
from neva.checkpoint.step import DCP_LOOP_STATE
from tests.checkpoint.tiny_hf import make_clip_dir, make_llama_dir, one_thread
from tests.parallel.llava_data import write_llava_set

REPO = Path(__file__).resolve().parents[1]
# What the README's runs are cut to here (a few steps, a checkpoint every 2, no validation or progress bar).
SHORT = (
    "trainer.max_steps=3 model.micro_batch_size=2 model.global_batch_size=4 trainer.val_check_interval=1000 "
    "exp_manager.checkpoint_callback_params.every_n_train_steps=2 trainer.enable_progress_bar=false "
    "exp_manager.create_tensorboard_logger=false"
)
pytestmark = pytest.mark.slow


def readme_block(title: str) -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split(f"## {title}", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def run(script: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` = this interpreter
    proc = subprocess.run(["bash", "-euc", script], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, (script[-600:], proc.stderr[-3000:])


def test_readme_newcomer_path_runs_end_to_end(tmp_path):
    with one_thread():
        make_llama_dir(tmp_path / "models" / "llm")
        make_clip_dir(tmp_path / "models" / "clip")
    data = tmp_path / "data"
    write_llava_set(data, n=16)
    records = json.loads((data / "data.json").read_text())
    (data / "conversations.json").write_text(json.dumps(records))
    captions = [{**r, "conversations": r["conversations"][:2]} for r in records if r.get("image")]  # one turn each
    (data / "captions.json").write_text(json.dumps(captions))
    questions = [{"question_id": i, "image": f"00{i}_0.png", "text": "What is in the image?"} for i in (0, 2)]
    (data / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    work = tmp_path / "work"
    work.mkdir()
    # The quick start in the same place first (short): outputs/pretrain/final and outputs/finetune/final exist.
    quick = f"python -m neva.train +stage=pretrain {SHORT} && python -m neva.train +stage=finetune {SHORT}"
    run(quick, work)
    assert (work / "outputs" / "pretrain" / "final").is_dir()

    block = readme_block("Your own models, start to finish")
    block = block.replace("/models/llm", str(tmp_path / "models" / "llm"))
    block = block.replace("/models/clip", str(tmp_path / "models" / "clip"))
    block = block.replace("/data/", f"{data}/")
    block = re.sub(r"^(python -m neva\.train .*)$", rf"\1 {SHORT}", block, flags=re.M)
    run(block, work)

    runs = work / "runs"
    # both finetunes started from the pretrain they name, recorded absolutely in their step checkpoints
    for stage in ("finetune", "lora"):
        last = runs / stage / "checkpoints" / "last.ckpt"
        state = verified.load_state(last if last.is_file() else last / DCP_LOOP_STATE)
        assert state[START_KEY]["path"] == str(runs / "pretrain" / "final"), state[START_KEY]
    assert json.loads((runs / "hf" / "config.json").read_text())["model_type"] == "llava"
    assert (runs / "hf-last-step" / "config.json").is_file()  # exported from another directory
    assert (runs / "hf-lora-adapter" / "adapter_config.json").is_file()
    answers = [json.loads(line) for line in (runs / "answers.jsonl").read_text().splitlines()]
    assert [a["question_id"] for a in answers] == [0, 2]
