"""Fixtures for the data tests: tokenizers built in code (no downloads) and LLaVA-format files on disk."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from neva.models.config import VisionConfig

LLAMA_CORPUS = [
    "A chat between a curious user and an artificial intelligence assistant.",
    "The assistant gives helpful, detailed, and polite answers to the user's questions.",
    "USER: What is in the image? ASSISTANT: A red circle on a dark background.",
    "[INST] <<SYS>> You are a helpful language and vision assistant. <</SYS>> [/INST] yes no",
    "The quick brown fox jumps over the lazy dog 0123456789 how many shapes are there",
]


@pytest.fixture(scope="session")
def synthetic_tokenizer():
    from neva.data.synthetic import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def llama_tokenizer_dir(tmp_path_factory) -> str:
    """A tiny sentencepiece Llama tokenizer (non-legacy, BOS added) with ``<image>`` special, saved to a dir."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    d = tmp_path_factory.mktemp("llama_tok")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(LLAMA_CORPUS * 10))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "sp"), vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    src = d / "src"
    src.mkdir()
    shutil.copy(d / "sp.model", src / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(str(src), legacy=False, add_bos_token=True)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    out = d / "tok"
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def llama_tokenizer(llama_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_tokenizer_dir)


@pytest.fixture
def vision() -> VisionConfig:
    return VisionConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)


def write_image(path, size=(40, 30), seed=0, fmt="PNG") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format=fmt)


def write_jsonl(path, records) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def qa(image="a.png", q="<image>\nWhat is it?", a="A red circle.", rid="s0", turns=1):
    conv = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    for i in range(1, turns):
        conv += [{"from": "human", "value": f"And then {i}?"}, {"from": "gpt", "value": f"Yes {i}."}]
    rec = {"id": rid, "conversations": conv}
    if image is not None:
        rec["image"] = image
    return rec
