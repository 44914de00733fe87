"""ScienceQA end to end: the letter instruction appended, eval_science_qa.py's option parsing and accuracy."""

import re

from neva.benchmarks import scienceqa
from tests.benchmarks.conftest import ANSWER_FIELDS, draw, run_suite, write_json

INSTRUCTION = "Answer with the option's letter from the given choices directly."


def letter_of(text: str, n_choices: int) -> int:
    """eval_science_qa.py's parsing written independently: the choice index, -1 when none is read."""
    letters = "ABCDE"[:n_choices]
    if len(text) == 1 and text in "ABCDE":
        pick = text
    elif re.match(r"^[A-E]\. ", text):
        pick = text[0]
    else:
        found = re.findall(r"The answer is ([A-Z]).", text)
        pick = found[0] if len(found) == 1 else ""
    return letters.index(pick) if pick and pick in letters else -1


def make_sqa(root):
    folder = root / "scienceqa"
    problems = {"1": {"choices": ["a", "b"], "answer": 0}, "2": {"choices": ["x", "y", "z"], "answer": 2},
                "3": {"choices": ["p", "q"], "answer": 1}, "9": {"choices": ["p", "q"], "answer": 1}}  # fmt: skip
    questions = [
        {"id": "1", "image": "1/image.png", "conversations": [{"from": "human", "value": "<image>\nContext: c\nQuestion: q1?\nOptions: (A) a (B) b"}]},
        {"id": "2", "conversations": [{"from": "human", "value": "Question: q2?\nOptions: (A) x (B) y (C) z"}]},
        {"id": "3", "image": "3/image.png", "conversations": [{"from": "human", "value": "<image>\nQuestion: q3?\nOptions: (A) p (B) q"}]},
        {"id": "4"},
    ]  # fmt: skip
    draw(folder / "images" / "test" / "1" / "image.png", 1)
    draw(folder / "images" / "test" / "3" / "image.png", 3)
    write_json(folder / "llava_test_CQM-A.json", questions)
    write_json(folder / "problems.json", problems)
    write_json(folder / "pid_splits.json", {"test": ["1", "2", "3", "9"], "val": []})
    return problems


def test_scienceqa_answers_and_accuracy(tiny_checkpoint, tmp_path, capsys):
    problems = make_sqa(tmp_path)
    result, answers = run_suite("scienceqa", tiny_checkpoint, tmp_path, tmp_path / "out", capsys)
    assert all(set(a) == ANSWER_FIELDS for a in answers) and [a["question_id"] for a in answers] == ["1", "2", "3"]
    assert answers[0]["prompt"] == f"<image>\nContext: c\nQuestion: q1?\nOptions: (A) a (B) b\n{INSTRUCTION}"
    assert answers[1]["prompt"] == f"Question: q2?\nOptions: (A) x (B) y (C) z\n{INSTRUCTION}"
    assert result["skipped"] == 1  # record "4" has no question
    right = [letter_of(a["text"], len(problems[a["question_id"]]["choices"])) == problems[a["question_id"]]["answer"]
             for a in answers]  # fmt: skip
    assert result["correct"] == sum(right) and result["count"] == 4  # "9" never asked: FAILED
    assert result["accuracy"] == 100 * sum(right) / 4 and result["image_count"] == 2


def test_option_parsing_as_eval_science_qa():
    for text in ["A", "B. yes", "The answer is C.", "E", "", "AB", "The answer is A. The answer is B.", "b", "C.x"]:
        parsed = scienceqa.parse_option(text)
        assert ("ABCDE".index(parsed) if parsed else -1) == letter_of(text, 5), text
