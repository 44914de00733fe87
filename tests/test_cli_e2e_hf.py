"""Done-means for HF interop: a llava-hf dir made by transformers → ``neva.convert`` → ``neva.generate`` prints what
transformers' greedy ``generate`` prints; ``neva-to-hf`` reloads in transformers with identical logits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from neva.convert import main as convert_main
from tests.checkpoint.tiny_hf import make_llava_dir

REPO = Path(__file__).resolve().parents[1]
PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
NEW_TOKENS = 12


def run(*args: str) -> str:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, encoding="utf-8"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_llava_hf_through_neva_cli(tmp_path):
    hf_dir, ckpt = tmp_path / "llava-hf", tmp_path / "ckpt"
    model, _ = make_llava_dir(hf_dir, seed=5)
    image_path = tmp_path / "photo.png"
    pixels = np.random.default_rng(0).integers(0, 256, (37, 45, 3), dtype=np.uint8)  # not square: resize + crop
    Image.fromarray(pixels).save(image_path)

    run("neva.convert", "hf-to-neva", "--hf", str(hf_dir), "--out", str(ckpt))
    assert json.loads((ckpt / "config.json").read_text())["format"] == "neva"
    printed = run(
        "neva.generate",
        *("--checkpoint", str(ckpt), "--image", str(image_path), "--prompt", PROMPT),
        *("--raw", "--greedy", "--max-new-tokens", str(NEW_TOKENS)),
    )

    processor = AutoProcessor.from_pretrained(hf_dir)
    inputs = processor(images=Image.open(image_path), text=PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert expected.strip()  # a non-trivial comparison
    assert printed == expected + "\n"

    convert_main(["neva-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "exported")])
    exported = LlavaForConditionalGeneration.from_pretrained(tmp_path / "exported").eval()
    assert torch.equal(
        AutoProcessor.from_pretrained(tmp_path / "exported")(
            images=Image.open(image_path), text=PROMPT, return_tensors="pt"
        )["pixel_values"],
        inputs["pixel_values"],
    )
    with torch.no_grad():
        assert torch.equal(exported(**inputs).logits, model(**inputs).logits)
