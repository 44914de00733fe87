"""``neva.generate`` and ``neva.evaluate`` answer through one front end: same prompts, same greedy answers."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from neva.checkpoint.neva_format import save_checkpoint
from neva.data.synthetic import build_tokenizer
from neva.evaluate import main as evaluate_main
from neva.generate import main as generate_main
from neva.inference import Answerer
from neva.models.generation import GenerationConfig
from neva.models.neva import NevaModel
from neva.models.presets import build_config
from tests.checkpoint.tiny_hf import one_thread

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny model with the synthetic tokenizer, plus two images and a question file."""
    root = tmp_path_factory.mktemp("infer")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = NevaModel(
        build_config(vocab_size=len(tokenizer), image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    )
    model.init_weights()
    save_checkpoint(root / "ckpt", model.cfg, model.state_dict(), tokenizer, metadata={"conv_template": "vicuna_v1"})
    rng = np.random.default_rng(0)
    for name, size in (("a.png", (30, 41)), ("b.png", (32, 32))):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / name)
    questions = [
        {"question_id": 7, "image": "a.png", "text": "What color are the shapes?", "answer": "red"},
        {"id": "x", "image": ["a.png", "b.png"], "prompt": "<image> or <image>: which is brighter?"},
        {"question_id": 9, "text": "How many shapes are there?"},
    ]
    (root / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    return root


@one_thread()
def test_evaluate_file_writes_the_answers_generate_gives(checkpoint, capsys):
    root = checkpoint
    common = ["--checkpoint", str(root / "ckpt"), "--max-new-tokens", str(NEW_TOKENS)]
    evaluate_main([*common, "--input-file", str(root / "q.jsonl"), "--output-file", str(root / "a.jsonl")])
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 3 and result["n_scored"] == 1 and result["checkpoint"] == str((root / "ckpt").resolve())
    answers = [json.loads(line) for line in (root / "a.jsonl").read_text().splitlines()]
    assert [(a["question_id"], a["model_id"]) for a in answers] == [(7, "ckpt"), ("x", "ckpt"), (9, "ckpt")]
    assert answers[1]["prompt"] == "<image> or <image>: which is brighter?" and all(a["text"] for a in answers)

    records = [json.loads(line) for line in (root / "q.jsonl").read_text().splitlines()]
    prompts = [{**r, "prompt": r.get("text", r.get("prompt"))} for r in records]
    (root / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    generate_main([*common, "--device", "cpu", "--input-file", str(root / "p.jsonl"), "--batch-size", "2"])
    generated = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [g["id"] if "id" in g else g["question_id"] for g in generated] == [7, "x", 9]
    assert [g["answer"].strip() for g in generated] == [a["text"] for a in answers]


@one_thread()
def test_evaluate_synthetic_prints_accuracy_per_kind(checkpoint, capsys):
    evaluate_main(["--checkpoint", str(checkpoint / "ckpt"), "--limit", "5", "--max-new-tokens", "3"])
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 5 and 0.0 <= result["accuracy"] <= 1.0
    assert set(result["per_kind"]) <= {"color", "shape", "count", "position"} and len(result["examples"]) == 5


@one_thread()
def test_images_as_paths_or_pil_and_batching_give_the_same_answers(checkpoint):
    root = checkpoint
    answerer = Answerer(root / "ckpt", GenerationConfig(max_new_tokens=NEW_TOKENS))
    with Image.open(root / "a.png") as image:
        pil = image.copy()
    items = [("Describe it.", [root / "a.png"]), ("Say hello.", []), ("Describe it.", [pil])]
    one_batch = answerer.answer(items)
    assert one_batch[0] == one_batch[2]
    assert list(answerer.answer_all(items, batch_size=1)) == one_batch
    with pytest.raises(ValueError, match="1 <image> tag"):
        answerer.answer([("<image> Describe it.", [])])
