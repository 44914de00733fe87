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
from tests.forked_python import run_script
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


def run(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """The script in bash, each ``python -m`` forked from the harness's server (``tests/forked_python.py``: the
    commands as written, without an interpreter start-up each)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` = this interpreter
    proc = run_script(script, cwd, env)
    assert proc.returncode == 0, (script[-600:], proc.stderr[-3000:])
    return proc


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


def test_readme_qwen_path_runs_end_to_end(tmp_path):
    """The README's Qwen-VL block on a tiny Qwen2.5-VL built with transformers: import, whole and LoRA finetunes, DPO
    without repeating the template, generate in both modes, merged and PEFT exports, evaluate; then the exports in
    transformers: greedy tokens equal neva's, generation stops at ``<|im_end|>``, base + adapter = the merged run."""
    import torch
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

    from neva.checkpoint.hf_qwen_vl import export_qwen_vl
    from neva.checkpoint.neva_format import load_metadata
    from neva.checkpoint.step import materialize
    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig as Decoding
    from tests.fixtures.tiny_qwen_vl import hf_inputs, pixel_budget, tiny_qwen_vl_dir

    with one_thread():
        tiny_qwen_vl_dir(tmp_path / "models", "qwen2_5_vl")
    data = tmp_path / "data"
    write_llava_set(data, n=16)
    records = json.loads((data / "data.json").read_text())
    (data / "conversations.json").write_text(json.dumps(records))
    pairs = [
        {"id": r["id"], "image": r["image"], "prompt": r["conversations"][0]["value"], "chosen": "a red circle",
         "rejected": "a blue square"}
        for r in records if isinstance(r.get("image"), str)
    ]  # fmt: skip
    (data / "pairs.json").write_text(json.dumps(pairs))
    questions = [{"question_id": i, "image": f"00{i}_0.png", "text": "What is in the image?"} for i in (0, 2)]
    (data / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    work = tmp_path / "work"
    work.mkdir()
    block = readme_block("A Qwen-VL model, start to finish")
    block = block.replace("/models/qwen2_5_vl", str(tmp_path / "models" / "qwen2_5_vl")).replace("/data/", f"{data}/")
    block = re.sub(r"^(python -m neva\.train .*)$", rf"\1 {SHORT}", block, flags=re.M)
    proc = run(block, work)

    runs = work / "qwen"
    screen = proc.stdout + proc.stderr
    # the first screen: what each stage took from its start and its resolved essentials, no warnings about keys never
    # set nor Lightning's about logging intervals or an empty validation set
    assert f"from {runs}/finetune/final (what it was trained with): model.data.conv_template='qwen2_vl'" in screen
    assert "run: stage dpo, model from" in screen and "template qwen2_vl" in screen
    for line in ("is ignored", "logging interval", "Total length of `list`"):
        assert line not in screen, line
    budget = dict(zip(("min_pixels", "max_pixels"), pixel_budget("qwen2_5_vl")))
    for stage in ("finetune", "dpo"):  # the import's template and pixel budget, never given again
        meta = load_metadata(runs / stage / "final")
        assert (meta["conv_template"], meta["min_pixels"], meta["max_pixels"]) == ("qwen2_vl", *budget.values())
    answers = [json.loads(line) for line in (runs / "answers.jsonl").read_text().splitlines()]
    assert [a["question_id"] for a in answers] == [0, 2]

    image = Image.open(data / "images" / "000_0.png").convert("RGB")
    with one_thread(), torch.no_grad():
        hf_dir = runs / "hf"
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        processor = AutoImageProcessor.from_pretrained(str(hf_dir))
        assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == tuple(budget.values())
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        eos = GenerationConfig.from_pretrained(str(hf_dir)).eos_token_id
        assert im_end in (eos if isinstance(eos, list) else [eos])  # transformers' generate stops at the turn
        # The exported chat template renders the prompt as neva served it; transformers' greedy tokens = neva's.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "<image>\nWhat is in the image?"}], add_generation_prompt=True, tokenize=False
        )
        inputs = hf_inputs(tokenizer, processor, text, [image])
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1] :].tolist()
        answerer = Answerer(runs / "dpo" / "final", Decoding(max_new_tokens=8))
        prepared = answerer.prepare(("What is in the image?", [image]))
        assert prepared.ids == inputs["input_ids"][0].tolist()
        assert answerer.generate_ids([prepared])[0] == out

        # The LoRA run: base + PEFT adapter in transformers = the run's merged weights exported.
        merged = export_qwen_vl(
            materialize(runs / "lora" / "checkpoints" / "last.ckpt", tmp_path / "m"), tmp_path / "mh"
        )
        base = AutoModelForImageTextToText.from_pretrained(str(runs / "hf-lora-base")).eval()
        adapted = PeftModel.from_pretrained(base, str(runs / "hf-lora-adapter")).eval()
        want = AutoModelForImageTextToText.from_pretrained(str(merged)).eval()(**inputs).logits
        torch.testing.assert_close(adapted(**inputs).logits, want, rtol=1e-4, atol=1e-4)
