"""TextVQA end to end: answers matched to annotations by (question_id, question in the prompt), soft VQA accuracy."""

from neva.benchmarks.vqa_normalize import normalize_vqa_answer, vqa_soft_score
from tests.benchmarks.conftest import ANSWER_FIELDS, draw, run_suite, write_json, write_jsonl

SHORT = "Answer the question using a single word or phrase."


def soft_accuracy(prediction: str, humans: list[str]) -> float:
    """The VQA rule written independently: mean over each human left out of min(1, others agreeing / 3)."""
    matches = [h == prediction for h in humans]
    return sum(min(1.0, (sum(matches) - m) / 3) for m in matches) / len(humans)


def test_textvqa_answers_and_accuracy(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "textvqa"
    records, data = [], []
    for i, (question, humans) in enumerate([("what brand is it?", ["sony"] * 4 + ["canon"] * 6),
                                            ("what year?", ["1990"] * 10), ("what does it say?", ["stop"] * 2 + ["x"] * 8)]):  # fmt: skip
        image_id = f"{i:016x}"
        draw(folder / "train_images" / f"{image_id}.jpg", i)
        text = f"{question}\nReference OCR token: abc, def\n{SHORT}"
        records.append({"question_id": image_id, "image": f"{image_id}.jpg", "text": text})
        data.append({"image_id": image_id, "question": question, "answers": humans})
    write_jsonl(folder / "llava_textvqa_val_v051_ocr.jsonl", records)
    write_json(folder / "TextVQA_0.5.1_val.json", {"data": data})
    result, answers = run_suite("textvqa", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert all(set(a) == ANSWER_FIELDS for a in answers) and [a["prompt"] for a in answers] == [
        r["text"] for r in records
    ]
    want = [soft_accuracy(normalize_vqa_answer(a["text"]), d["answers"]) for a, d in zip(answers, data)]
    assert (
        result["accuracy"] == 100 * sum(want) / 3
        and result["units"] == {"accuracy": "percent"}
        and result["n"] == 3
        and result["unmatched"] == 0
    )


def test_soft_accuracy_after_normalisation():
    humans = ["two", "2", "2 ", "the 2", "Two.", "3", "three", "3", "4", "four"]
    assert vqa_soft_score("Two", humans) == soft_accuracy("2", ["2"] * 5 + ["3"] * 3 + ["4"] * 2) == 1.0
    assert vqa_soft_score("3.", humans) == soft_accuracy("3", ["2"] * 5 + ["3"] * 3 + ["4"] * 2) == 0.9
    assert vqa_soft_score("four", humans) == soft_accuracy("4", ["2"] * 5 + ["3"] * 3 + ["4"] * 2)
    assert normalize_vqa_answer("It's a dog, isnt it?") == "it 's dog isn't it"
    assert normalize_vqa_answer("1,000 (one) man") == "1000 1 man"
