"""The user's own tokenizer, exactly: a directory's ids through neva are the ids its own tokenizer gives.

sentencepiece models are trained here (BPE, user-defined pieces, byte fallback on and off) and saved as the two HF
layouts: a slow ``LlamaTokenizer`` directory (``tokenizer.model``, ``legacy`` true and false) and a fast one
(``tokenizer.json``). The reference for a slow directory is transformers 4.x's ``LlamaTokenizer(use_fast=False)``
(4.46.3, in its cached environment, ``tests/pip_site.py``), the class LLaVA's trainer and every 4.x user loaded it
with; for a fast one, the ``tokenizers`` library on its ``tokenizer.json``. The corpus has every kind of piece:
user-defined pieces at the start, after a space, inside words and next to special tokens, added tokens, bytes
outside the vocabulary, unknown characters, runs of spaces, newlines and tabs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sentencepiece = pytest.importorskip("sentencepiece")

from neva.data.sentencepiece_tokenizer import SentencePieceLlamaTokenizer, load_tokenizer  # noqa: E402
from neva.data.tokens import add_vision_tokens  # noqa: E402
from tests.pip_site import cached_site  # noqa: E402

T4_PINS = ("transformers==4.46.3", "tokenizers==0.20.3", "huggingface_hub==0.26.5", "requests", "urllib3", "idna",
           "certifi", "charset_normalizer")  # fmt: skip
LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A cat sits on the mat next to a red ball.",
    "What is in the image? Describe it in detail.",
    "USER: ASSISTANT: a picture of a red square and a blue circle",
    "hello world, this is a tiny tokenizer for tests 0123456789",
]
USER_PIECES = ["USER", "ASSISTANT", "<sep>", "▁Q"]
CORPUS = [
    "USER: hi ASSISTANT: hello</s>",
    " USER:",
    "A chat. USER: <image>\nWhat is it? ASSISTANT: a red ball</s>USER: and?",
    "Q<sep>Q QUSER xUSERx",
    "héllo wörld 你好 😀",
    "  two  spaces\n\nnewline\tTab ",
    "<s>USER</s> x<image><image> y",
    "0123 4567 ▁Q ▁ raw▁",
    "the lazy dog",
    "",
]
# transformers 4.x's slow tokenizer on each directory: ids with and without special tokens, after <image> / <pad> are
# added as neva adds them (add_vision_tokens: extra special tokens).
REFERENCE = r"""
import json, sys
from transformers import AutoTokenizer
corpus = json.loads(sys.argv[1])
out = {}
for d in sys.argv[2:]:
    tok = AutoTokenizer.from_pretrained(d, use_fast=False)
    assert type(tok).__name__ == "LlamaTokenizer", type(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.add_special_tokens({"pad_token": "<pad>"})
    out[d] = {"ids": [tok(s)["input_ids"] for s in corpus],
              "plain": [tok(s, add_special_tokens=False)["input_ids"] for s in corpus]}
print(json.dumps(out))
"""


def train_model(prefix: Path, byte_fallback: bool, user_pieces: list[str]) -> Path:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES * 10), model_prefix=str(prefix), vocab_size=320 if byte_fallback else 80,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=byte_fallback,
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True, minloglevel=2,
        user_defined_symbols=user_pieces,
    )  # fmt: skip
    return prefix.with_suffix(".model")


def slow_dir(directory: Path, model: Path, legacy: bool | None) -> Path:
    """A slow ``LlamaTokenizer`` directory as 4.x saves one (``legacy`` absent when None: 4.x's default, true)."""
    directory.mkdir(parents=True)
    (directory / "tokenizer.model").write_bytes(model.read_bytes())
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
              "model_max_length": 2048, "clean_up_tokenization_spaces": False, "sp_model_kwargs": {}}  # fmt: skip
    if legacy is not None:
        config["legacy"] = legacy
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    dirs = []
    for fallback in (True, False):
        model = train_model(root / f"sp_bf{int(fallback)}", fallback, USER_PIECES)
        for legacy in (True, False, None):
            dirs.append(slow_dir(root / f"slow_bf{int(fallback)}_legacy{legacy}", model, legacy))
    plain = train_model(root / "sp_plain", True, [])
    dirs.append(slow_dir(root / "slow_plain", plain, False))
    return root, dirs


@pytest.fixture(scope="module")
def reference(directories):
    _, dirs = directories
    site = cached_site("transformers-4.46.3", T4_PINS)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", REFERENCE, json.dumps(CORPUS), *map(str, dirs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, encoding="utf-8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def neva_tokenizer(directory: Path):
    tok = load_tokenizer(directory)
    add_vision_tokens(tok)
    return tok


def test_slow_directories_give_transformers_4_slow_ids(directories, reference):
    _, dirs = directories
    for directory in dirs:
        tok = neva_tokenizer(directory)
        assert isinstance(tok, SentencePieceLlamaTokenizer)
        ref = reference[str(directory)]
        assert [tok(s)["input_ids"] for s in CORPUS] == ref["ids"], directory.name
        assert [tok(s, add_special_tokens=False)["input_ids"] for s in CORPUS] == ref["plain"], directory.name
        # The offsets pass (neva's masks) gives the same ids.
        assert [tok(s, return_offsets_mapping=True)["input_ids"] for s in CORPUS] == ref["ids"], directory.name


def test_user_defined_pieces_stay_whole(directories, reference):
    """The issue's case: LLaVA-1.5's v1 template's `` USER`` is ``▁ USER``, not ``▁U S <0x45> R``."""
    root, _ = directories
    tok = neva_tokenizer(root / "slow_bf1_legacyFalse")
    assert tok.convert_ids_to_tokens(tok(" USER:", add_special_tokens=False)["input_ids"]) == ["▁", "▁", "USER", ":"]
    assert "USER" in tok.convert_ids_to_tokens(tok("A chat. USER: hi")["input_ids"])


def test_offsets_cover_each_piece(directories):
    """Every token's span is the text it stands for (a byte-fallback character's bytes all span it), and a slow
    directory without user-defined pieces gives the offsets transformers 5's fast conversion gives for it."""
    root, dirs = directories
    for directory in dirs:
        tok = neva_tokenizer(directory)
        for text in CORPUS:
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            pieces = tok.convert_ids_to_tokens(enc["input_ids"])
            for piece, (start, end) in zip(pieces, enc["offset_mapping"]):
                assert 0 <= start <= end <= len(text)
                if piece.startswith("<0x") or piece == "<unk>":
                    assert end > start, (directory.name, text, piece)
                elif piece not in ("▁",) and not piece.startswith("▁"):
                    assert text[start:end] == piece, (directory.name, text, piece)
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(root / "slow_plain")  # user-pieceless: transformers 5's conversion is exact
    ours = load_tokenizer(root / "slow_plain")
    compared = 0
    for text in CORPUS:
        a = ours(text, return_offsets_mapping=True)
        b = fast(text, return_offsets_mapping=True)
        if a["input_ids"] != b["input_ids"]:  # leading spaces: the fast conversion's ids differ (4.x's are ours)
            continue
        compared += 1
        assert [tuple(o) for o in a["offset_mapping"]] == [tuple(o) for o in b["offset_mapping"]], text
    assert compared >= 6


def test_saved_directory_reloads_with_the_same_rules(directories, reference, tmp_path):
    """neva's checkpoint saves the slow tokenizer as 4.x would (class, legacy, bos / eos): neva reloads it with
    the same ids, and so does transformers 4.x."""
    root, _ = directories
    for name in ("slow_bf1_legacyFalse", "slow_bf0_legacyTrue"):
        tok = neva_tokenizer(root / name)
        tok.save_pretrained(tmp_path / name)
        again = load_tokenizer(tmp_path / name)
        assert isinstance(again, SentencePieceLlamaTokenizer)
        assert [again(s)["input_ids"] for s in CORPUS] == reference[str(root / name)]["ids"], name
        assert len(again) == len(tok) and again.pad_token == "<pad>"


def test_fast_tokenizer_json_is_read_as_it_is(directories, tmp_path):
    """A ``tokenizer.json`` directory (a fast tokenizer whose pipeline is not Llama's: a lowercasing normalizer)
    gives the ``tokenizers`` library's own ids on its file."""
    from tokenizers import Tokenizer, normalizers
    from transformers import AutoTokenizer

    root, _ = directories
    fast = AutoTokenizer.from_pretrained(root / "slow_plain")
    backend = fast.backend_tokenizer
    backend.normalizer = normalizers.Lowercase()
    fast.save_pretrained(tmp_path / "fast")
    assert (tmp_path / "fast" / "tokenizer.json").is_file()
    own = Tokenizer.from_file(str(tmp_path / "fast" / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "fast")
    assert not isinstance(tok, SentencePieceLlamaTokenizer)
    for text in CORPUS:
        assert tok(text)["input_ids"] == own.encode(text).ids, text
