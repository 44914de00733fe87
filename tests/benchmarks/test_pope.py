"""POPE end to end: LLaVA's layout in, model_vqa_loader's answers out, the per-split scores of eval_pope.py."""

from neva.benchmarks import pope
from neva.benchmarks.files import Question
from tests.benchmarks.conftest import ANSWER_FIELDS, draw, run_suite, write_jsonl

SPLITS = ("adversarial", "random")
LABELS = {"adversarial": ["yes", "no", "no"], "random": ["no", "yes"]}


def expected(texts: list[str], labels: list[str]) -> dict:
    """eval_pope.py's rule, written out independently: first sentence, no commas, a no-word means no."""
    preds = []
    for text in texts:
        first = text.split(".", 1)[0].replace(",", "")
        preds.append("no" if any(w in ("No", "no", "not") for w in first.split(" ")) else "yes")
    tp = sum(p == "yes" and g == "yes" for p, g in zip(preds, labels))
    fp = sum(p == "yes" and g == "no" for p, g in zip(preds, labels))
    tn = sum(p == "no" and g == "no" for p, g in zip(preds, labels))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / labels.count("yes")
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"accuracy": (tp + tn) / len(labels), "precision": precision, "recall": recall, "f1": f1,
            "yes_ratio": preds.count("yes") / len(preds)}  # fmt: skip


def make_pope(root):
    pope_dir = root / "pope"
    questions, qid = [], 100
    for split in SPLITS:
        lines = []
        for i, label in enumerate(LABELS[split]):
            image = f"COCO_val2014_{qid:012d}.jpg"
            draw(pope_dir / "val2014" / image, qid)
            text = f"Is there a {'cat' if i % 2 else 'dog'} in the image?\nAnswer the question using a single word or phrase."
            questions.append({"question_id": qid, "image": image, "text": text, "category": split})
            lines.append({"question_id": i + 1, "image": image, "text": text.split("\n")[0], "label": label})
            qid += 1
        write_jsonl(pope_dir / "coco" / f"coco_pope_{split}.json", lines)
    write_jsonl(pope_dir / "llava_pope_test.jsonl", questions)
    return questions


def test_pope_answers_and_scores_as_llava(tiny_checkpoint, tmp_path, capsys):
    questions = make_pope(tmp_path)
    result, answers = run_suite("pope", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert all(set(a) == ANSWER_FIELDS and isinstance(a["text"], str) for a in answers)
    assert [a["question_id"] for a in answers] == [q["question_id"] for q in questions]
    assert [a["prompt"] for a in answers] == [q["text"] for q in questions]
    for split in SPLITS:
        texts = [a["text"] for a, q in zip(answers, questions) if q["category"] == split]
        want = expected(texts, LABELS[split])
        got = result["splits"][split]
        assert {k: got[k] for k in want} == want
    assert result["skipped"] == 0 and result["questions"] == 5


def test_pope_scorer_reads_yes_and_no_as_eval_pope(tmp_path):
    texts = ["No, there is not.", "Yes. No dog", "There is not a dog", "yes", "NO", "Yes, no doubt"]
    labels = ["no", "yes", "yes", "no", "no", "yes"]
    answered = [(Question(i, "", "", meta={"category": "random"}), {"text": t}) for i, t in enumerate(texts)]
    write_jsonl(tmp_path / "coco" / "coco_pope_random.json", [{"label": label} for label in labels])
    got = pope.score(tmp_path, answered, tmp_path)["splits"]["random"]
    want = expected(texts, labels)
    assert {k: got[k] for k in want} == want and 0 < want["f1"] < 1


def test_an_answers_file_is_scored_without_a_model(tmp_path, capsys):
    """``neva.evaluate --score ANSWERS_FILE --suite pope``: an answers file written elsewhere (one question left
    unanswered), scored by eval_pope.py's rule without a checkpoint (issue 52: only a fresh run could be scored)."""
    import json

    from neva import evaluate

    questions = make_pope(tmp_path)
    texts = ["Yes, there is.", "No.", "no", "There is a dog."]
    answers = [{"question_id": q["question_id"], "prompt": q["text"], "text": t} for q, t in zip(questions, texts)]
    write_jsonl(tmp_path / "answers.jsonl", answers)
    evaluate.main(["--score", str(tmp_path / "answers.jsonl"), "--suite", "pope", "--data-dir", str(tmp_path),
                   "--output-dir", str(tmp_path / "scored"), "--checkpoint", str(tmp_path / "no-model")])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["skipped"] == 1 and result["questions"] == 5
    want = expected(texts[:3], LABELS["adversarial"])
    assert {k: result["splits"]["adversarial"][k] for k in want} == want
    assert json.loads((tmp_path / "scored" / "scores.json").read_text())["splits"] == result["splits"]
