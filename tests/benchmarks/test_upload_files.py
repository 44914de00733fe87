"""VQAv2 and VizWiz: the EvalAI upload files as LLaVA's converters write them (normalised answers; every question of
the split the server expects)."""

import json

from neva.benchmarks.vqa_normalize import normalize_vqa_answer
from tests.benchmarks.conftest import draw, run_suite, write_jsonl

SHORT = "Answer the question using a single word or phrase."


def test_vqav2_upload(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "vqav2"
    asked = []
    for i in range(3):
        draw(folder / "test2015" / f"COCO_test2015_{i:012d}.jpg", i)
        asked.append({"question_id": 500 + i, "image": f"COCO_test2015_{i:012d}.jpg", "text": f"What is {i}?\n{SHORT}"})
    write_jsonl(folder / "llava_vqav2_mscoco_test-dev2015.jsonl", asked)
    write_jsonl(
        folder / "llava_vqav2_mscoco_test2015.jsonl", [*asked, {"question_id": 9, "image": "x.jpg", "text": "?"}]
    )
    result, answers = run_suite("vqav2", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    upload = json.loads((tmp_path / "out" / "vqav2_upload.json").read_text())
    want = [{"question_id": a["question_id"], "answer": normalize_vqa_answer(a["text"])} for a in answers]
    assert upload == [*want, {"question_id": 9, "answer": ""}] and result["answered"] == 3


def test_vizwiz_upload(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "vizwiz"
    asked = []
    for i in range(2):
        draw(folder / "test" / f"VizWiz_test_{i:08d}.jpg", i)
        text = f"What is this?\nWhen the provided information is insufficient, respond with 'Unanswerable'.\n{SHORT}"
        asked.append({"question_id": i, "image": f"VizWiz_test_{i:08d}.jpg", "text": text})
    write_jsonl(folder / "llava_test.jsonl", asked)
    result, answers = run_suite("vizwiz", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    upload = json.loads((tmp_path / "out" / "vizwiz_upload.json").read_text())
    assert upload == [{"image": q["image"], "answer": normalize_vqa_answer(a["text"])} for q, a in zip(asked, answers)]
    assert result["answered"] == 2
