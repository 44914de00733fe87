"""``neva.generate`` and ``neva.evaluate`` answer through one front end: same prompts, same greedy answers."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from neva.data.front_ends import FixedImages
from neva.evaluate import main as evaluate_main
from neva.generate import main as generate_main
from neva.inference import Answerer
from neva.models.generation import GenerationConfig
from tests.checkpoint.tiny_hf import one_thread

NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _restore_grad_mode():
    """``neva.evaluate.main`` turns autograd off for its whole process; tests that follow in this one need it back."""
    yield
    torch.set_grad_enabled(True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_checkpoint):
    """A random tiny model with the synthetic tokenizer, plus two images and a question file."""
    root = tmp_path_factory.mktemp("infer")
    shutil.copytree(tiny_checkpoint, root / "ckpt")
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


@one_thread()
def test_generate_file_answers_every_good_record_and_marks_the_bad_ones(checkpoint, capsys):
    """Records without a prompt, with a missing image, a named pipe as image or mismatched <image> tags, and a line
    that is not JSON, get an ``error`` each; the others, in the same batch, get the answers they get alone (nothing
    blocks on the pipe); the command exits 1."""
    root = checkpoint
    pipe = root / "pipe.png"
    if not pipe.exists():
        os.mkfifo(pipe)
    good = [{"id": 1, "image": "a.png", "prompt": "Describe it."}, {"id": 2, "prompt": "Say hello."}]
    lines = [
        json.dumps(good[0]),
        json.dumps({"id": "no prompt", "image": "a.png", "text": "Describe it."}),
        "{not json",
        json.dumps({"id": "missing image", "image": "nowhere.png", "prompt": "Describe it."}),
        json.dumps({"id": "tags", "prompt": "<image> and <image>?", "image": "a.png"}),
        json.dumps(["a list"]),
        json.dumps({"id": "pipe", "image": "pipe.png", "prompt": "Describe it."}),
        json.dumps(good[1]),
    ]
    (root / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    common = ["--checkpoint", str(root / "ckpt"), "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_:
        generate_main([*common, "--input-file", str(root / "mixed.jsonl"), "--batch-size", "8"])
    assert exit_.value.code == 1
    captured = capsys.readouterr()
    assert "6 of 8 records not answered" in captured.err
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert len(rows) == 8
    assert [("answer" in r, "error" in r) for r in rows] == [(True, False)] + [(False, True)] * 6 + [(True, False)]
    assert rows[1]["error"] == "the record has no 'prompt' string" and rows[1]["id"] == "no prompt"
    assert "mixed.jsonl:3 is not JSON" in rows[2]["error"]
    assert "nowhere.png" in rows[3]["error"] and rows[3]["id"] == "missing image"
    assert "2 <image> tag(s) but 1 image(s)" in rows[4]["error"]
    assert rows[5] == {"record": ["a list"], "error": "the record has no 'prompt' string"}
    assert "named pipe, not a regular file" in rows[6]["error"]
    answerer = Answerer(root / "ckpt", GenerationConfig(max_new_tokens=NEW_TOKENS))
    alone = answerer.answer([(g["prompt"], [root / g["image"]] if "image" in g else []) for g in good])
    assert [rows[0]["answer"], rows[7]["answer"]] == alone


@one_thread()
def test_generate_caps_max_new_tokens_at_the_context(checkpoint, capsys):
    root = checkpoint
    context = Answerer(root / "ckpt", GenerationConfig()).model.cfg.llm.max_seq_len
    args = ["--checkpoint", str(root / "ckpt"), "--device", "cpu", "--prompt", "Say hello.", "--max-new-tokens"]
    with pytest.warns(UserWarning, match=f"max_new_tokens=1000000000 does not fit .*max_seq_len={context}"):
        generate_main([*args, str(10**9)])
    capped = capsys.readouterr().out
    generate_main([*args, str(NEW_TOKENS)])
    assert capped.startswith(capsys.readouterr().out.rstrip("\n"))  # the same answer, continued up to the context


@one_thread()
def test_reply_losses_equal_the_training_loss_of_each_record(checkpoint):
    """The evaluator's teacher-forced reply loss is the loss training computes on the same LLaVA record: encoded by the
    data pipeline (template, labels), collated alone, the model's forward, the summed cross-entropy."""
    from neva.constants import IMAGE_TOKEN
    from neva.data.collate import Collator
    from neva.data.dataset import EncoderSettings, process_record
    from neva.data.images import CallableImageSource, ImageProcessor
    from neva.data.templates.registry import get_template
    from neva.models.loss import token_cross_entropy
    from neva.training.engine import model_inputs

    answerer = Answerer(checkpoint / "ckpt", GenerationConfig(max_new_tokens=1), dtype=torch.float32)
    images = {name: Image.open(checkpoint / name).convert("RGB") for name in ("a.png", "b.png")}
    scored = [
        ("What color are the shapes?", [images["a.png"]], "red"),
        ("Which is brighter?", [images["a.png"], images["b.png"]], "the second one, by far"),
        ("What is 2 plus 3?", [], "5"),
    ]
    got = answerer.reply_losses(scored)

    tokenizer, cfg = answerer.tokenizer, answerer.model.cfg
    settings = EncoderSettings(
        tokenizer, get_template("vicuna_v1", tokenizer), cfg.image_token_id, cfg.num_image_tokens, max_length=None
    )
    source = CallableImageSource(lambda name: images[name])
    for (question, imgs, reply), loss in zip(scored, got):
        names = [n for img in imgs for n, im in images.items() if im is img]
        human = f"{IMAGE_TOKEN}\n" * len(imgs) + question
        record = {"id": 0, "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": reply}]}
        sample = process_record({**record, "image": names} if names else record, settings, source,
                                FixedImages(ImageProcessor(cfg.vision)))  # fmt: skip
        batch = Collator(answerer.builder.pad_id(), seq_length=cfg.llm.max_seq_len)([sample])
        with torch.no_grad():
            logits = answerer.model(**model_inputs(batch, torch.device("cpu"), packed=False))
        expected, tokens = token_cross_entropy(logits, batch.labels)
        assert tokens >= 2  # the reply's token(s) and the end of turn
        assert loss == pytest.approx(float(expected), rel=1e-5)
