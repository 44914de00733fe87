"""GQA and SEED-Bench end to end: their prediction / upload files as LLaVA's converters write them, and the
exact-match accuracies."""

import json

from tests.benchmarks.conftest import ANSWER_FIELDS, draw, run_suite, write_json, write_jsonl

SHORT = "Answer the question using a single word or phrase."
LETTER = "Answer with the option's letter from the given choices directly."


def test_gqa_predictions_and_accuracy(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "gqa"
    records, truth = [], {}
    for i, (answer, structural) in enumerate([("yes", "verify"), ("left", "query"), ("no", "verify")]):
        draw(folder / "data" / "images" / f"n{i}.jpg", i)
        records.append({"question_id": f"20{i}", "image": f"n{i}.jpg", "text": f"Question {i}?\n{SHORT}"})
        truth[f"20{i}"] = {"answer": answer, "types": {"structural": structural, "semantic": "attr"}}
    write_jsonl(folder / "llava_gqa_testdev_balanced.jsonl", records)
    write_json(folder / "data" / "testdev_balanced_questions.json", truth)
    result, answers = run_suite("gqa", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert all(set(a) == ANSWER_FIELDS for a in answers)
    predictions = json.loads((tmp_path / "out" / "testdev_balanced_predictions.json").read_text())
    # convert_gqa_for_eval.py: the text without trailing periods, lower-cased
    assert predictions == [
        {"questionId": a["question_id"], "prediction": a["text"].rstrip(".").lower()} for a in answers
    ]
    right = [p["prediction"] == truth[p["questionId"]]["answer"] for p in predictions]
    assert result["accuracy"] == 100 * sum(right) / 3 and result["n"] == 3
    assert result["per_type"]["structural:verify"] == 100 * (right[0] + right[2]) / 2


def test_seed_upload_and_accuracy(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "seed_bench"
    records, questions = [], []
    for i, (kind, image) in enumerate([("image", "SEED-Bench-image/a.jpg"), ("video", "SEED-Bench-video-image/v.png"),
                                       ("image", "SEED-Bench-image/b.jpg")]):  # fmt: skip
        draw(folder / image, i)
        records.append({"question_id": 100 + i, "image": image, "text": f"Q{i}?\nA. x\nB. y\n{LETTER}"})
        questions.append({"question_id": str(100 + i), "answer": "AB"[i % 2], "question_type_id": 1 + i % 2,
                          "data_type": kind})  # fmt: skip
    questions.append({"question_id": "999", "answer": "A", "question_type_id": 1, "data_type": "image"})  # not asked
    write_jsonl(folder / "llava-seed-bench.jsonl", records)
    write_json(folder / "SEED-Bench.json", {"questions": questions, "question_type": {"Scene": 1, "Count": 2}})
    result, answers = run_suite("seed", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    upload = [json.loads(line) for line in (tmp_path / "out" / "seed_upload.jsonl").read_text().splitlines()]
    assert upload == [{"question_id": str(a["question_id"]), "prediction": a["text"]} for a in answers]
    right = [a["text"] == q["answer"] for a, q in zip(answers, questions)] + [False]
    assert result["accuracy"] == 100 * sum(right) / 4 and result["n"] == 4
    assert result["video_accuracy"] == 100 * right[1]
