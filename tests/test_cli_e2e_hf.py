"""Done-means for HF interop: a llava-hf dir made by transformers → ``neva.convert`` → ``neva.generate`` prints what
transformers' greedy ``generate`` prints; ``neva-to-hf`` reloads in transformers with identical logits."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from neva.convert import main as convert_main
from neva.generate import main as generate_main
from tests.checkpoint.tiny_hf import make_llava_dir, one_thread
from tests.parallel.harness import run_module

REPO = Path(__file__).resolve().parents[1]
PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
NEW_TOKENS = 12
pytestmark = pytest.mark.slow


def run(module: str, *args: str) -> str:
    """``python -m module *args``'s stdout, forked from the harness's server (``run_module``: no interpreter
    start-up)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = run_module(module, list(args), env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def save_image(path: Path, seed: int, size: tuple[int, int]) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny llava-hf dir made by transformers, converted by ``python -m neva.convert hf-to-neva``."""
    root = tmp_path_factory.mktemp("e2e")
    with one_thread():
        model, _ = make_llava_dir(root / "llava-hf", seed=5)
    save_image(root / "photo.png", 0, (37, 45))  # not square: resize + centre crop
    save_image(root / "other.png", 1, (50, 29))
    run("neva.convert", "hf-to-neva", "--hf", str(root / "llava-hf"), "--out", str(root / "ckpt"))
    assert json.loads((root / "ckpt" / "config.json").read_text())["format"] == "neva"
    return root, model


def hf_greedy_text(root: Path, model: LlavaForConditionalGeneration, prompt: str, images: list[str]) -> str:
    processor = AutoProcessor.from_pretrained(root / "llava-hf")
    inputs = processor(images=[Image.open(root / i) for i in images], text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@one_thread()
def test_generate_cli_prints_what_transformers_generates(converted):
    root, model = converted
    printed = run(
        "neva.generate",
        *("--checkpoint", str(root / "ckpt"), "--image", str(root / "photo.png"), "--prompt", PROMPT),
        *("--raw", "--greedy", "--max-new-tokens", str(NEW_TOKENS)),
    )
    expected = hf_greedy_text(root, model, PROMPT, ["photo.png"])
    assert expected.strip()  # a non-trivial comparison
    assert printed == expected + "\n"


@one_thread()
def test_batch_file_matches_single_prompts(converted, capsys):
    root, model = converted
    two = "USER: <image><image>\nWhich one is brighter? ASSISTANT:"
    records = [
        {"image": "photo.png", "prompt": PROMPT, "id": 0},
        {"image": ["photo.png", "other.png"], "prompt": two, "id": 1},
        {"prompt": "USER: Say hello. ASSISTANT:", "id": 2},
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["--checkpoint", str(root / "ckpt"), "--raw", "--max-new-tokens", str(NEW_TOKENS)]
    generate_main([*args, "--input-file", str(root / "prompts.jsonl"), "--output-file", str(root / "out.jsonl")])
    answers = [json.loads(line) for line in (root / "out.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == [0, 1, 2] and answers[1]["image"] == records[1]["image"]
    assert answers[0]["answer"] == hf_greedy_text(root, model, PROMPT, ["photo.png"])
    assert answers[1]["answer"] == hf_greedy_text(root, model, two, ["photo.png", "other.png"])
    # template mode and sampling run too (vicuna_v1 wraps the prompt; <image>\n is put in front)
    generate_main(
        ["--checkpoint", str(root / "ckpt"), "--image", str(root / "photo.png"), "--prompt", "Describe it."]
        + ["--template", "vicuna_v1", "--sample", "--max-new-tokens", "4"]
    )
    assert capsys.readouterr().out.endswith("\n")


@one_thread()
def test_neva_to_hf_reloads_with_identical_logits(converted):
    root, model = converted
    convert_main(["neva-to-hf", "--ckpt", str(root / "ckpt"), "--out", str(root / "exported")])
    exported = LlavaForConditionalGeneration.from_pretrained(root / "exported").eval()
    image = Image.open(root / "photo.png")
    inputs = AutoProcessor.from_pretrained(root / "llava-hf")(images=image, text=PROMPT, return_tensors="pt")
    again = AutoProcessor.from_pretrained(root / "exported")(images=image, text=PROMPT, return_tensors="pt")
    assert torch.equal(again["input_ids"], inputs["input_ids"])
    assert torch.equal(again["pixel_values"], inputs["pixel_values"])
    with torch.no_grad():
        assert torch.equal(exported(**inputs).logits, model(**inputs).logits)
