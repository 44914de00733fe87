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


def test_gqa_official_metrics_by_hand():
    """eval.py's binary / open accuracy, consistency, validity, plausibility and distribution, worked out by hand on
    six questions (one not balanced: not counted)."""
    from neva.benchmarks import gqa

    def q(answer, structural, group=None, entailed=(), detailed="", **more):
        return {"answer": answer, "isBalanced": True, "types": {"structural": structural, "semantic": "attr",
                "detailed": detailed}, "groups": {"global": group}, "entailed": list(entailed), **more}  # fmt: skip

    program = [
        {"operation": "select", "argument": "table"},
        {"operation": "verify color", "argument": "red"},
        {"operation": "query", "argument": "name"},
    ]  # fmt: skip  (the last step is not counted)
    truth = {
        "q1": q("yes", "verify", entailed=["q3", "q1"], semantic=program, question="Is the table red?"),
        "q2": q("left", "query", group="left"),
        "q3": q("no", "verify"),
        "q4": q("red", "query", group="color", detailed="colorCommon"),
        "q5": {**q("x", "query"), "isBalanced": False},
        "q6": q("blue", "choose", group="color", entailed=["q4", "q1", "q9"]),
    }
    predictions = {"q1": "yes", "q2": "right", "q3": "yes", "q4": "color", "q5": "x", "q6": "blue"}
    choices = {"q1": {"valid": ["yes", "no"], "plausible": ["yes", "no"]},
               "q2": {"valid": ["left", "right"], "plausible": ["left"]},
               "q3": {"valid": ["yes", "no"], "plausible": ["no"]},
               "q4": {"valid": ["red", "blue"], "plausible": ["red"]},
               "q6": {"valid": ["blue", "red"], "plausible": ["green"]}}  # fmt: skip
    got = gqa.official_metrics(truth, predictions, choices)
    # right: q1, q6 of five balanced; binary q1 q3 q6 (2 right), open q2 q4 (none)
    assert got["accuracy"] == 40.0 and got["n"] == 5
    assert abs(got["binary"] - 200 / 3) < 1e-12 and got["open"] == 0.0
    # q1 (right): its entailed q3 wrong → 0; q6 (right): q4 wrong, q1 right → 0.5; q9 was never answered
    assert got["consistency"] == 25.0 and got["consistency_missing_entailed"] == 1
    # every answer valid (q4's "color": a Common question's group is color / material / shape); plausible q1, q4
    assert got["validity"] == 100.0 and got["plausibility"] == 40.0
    # chi-square per group, weighted by its size: left (1 question): (0-1)²/1 = 1; color (2): red (0-1)²/1 + blue 0
    assert got["distribution"] == (1 * 1 + 1 * 2) / 3 / 100
    assert got["per_type"]["structural:verify"] == 50.0 and got["per_type"]["structural:choose"] == 100.0
    assert got["per_steps"] == {"2": 100.0} and got["per_words"] == {"4": 100.0}
    assert "validity" not in gqa.official_metrics(truth, predictions, None)
