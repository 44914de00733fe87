"""MMBench (dev, English): circular evaluation, each question asked once per option with the options rotated
(``model_vqa_mmbench.py --all-rounds``); a question counts only when every round picks its answer.

Layout (``mmbench/``): ``mmbench_dev_20230712.tsv`` (``index``, ``question``, ``hint``, ``A``..``D``, ``answer``,
``category``, ``image``: base64). A round's letter is read from its answer by MMBench's matching rule (VLMEvalKit's
``can_infer``: one option letter standing alone, else one option's text inside the answer); the official evaluation
then asks ChatGPT about the rest, which here count as wrong (``unparsed``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from neva.benchmarks.files import InlineImage, Question, Read, load_tsv, need
from neva.benchmarks.scienceqa import LETTER_INSTRUCTION

DEV_FILE = "mmbench_dev_20230712.tsv"
LETTERS = ("A", "B", "C", "D")


def _absent(value: str | None) -> bool:
    """model_vqa_mmbench's ``is_none``: an empty cell (what pandas reads as NaN), or ``nan`` / ``none`` written out."""
    return value is None or value.lower() in ("", "nan", "none")


def read(folder: Path) -> Read:
    read = Read([])
    for row in load_tsv(need(folder / DEV_FILE)):
        options = []
        for letter in LETTERS:  # up to the first absent option
            if _absent(row.get(letter)):
                break
            options.append(row[letter])
        if _absent(row.get("image")):
            read.skipped += 1
            continue
        image = InlineImage(row["image"])
        index = int(row["index"])
        stem = row["question"] if _absent(row.get("hint")) else f"{row['hint']}\n{row['question']}"
        answer = LETTERS.index(row["answer"]) if row.get("answer") in LETTERS else None
        for r in range(len(options)):  # round r shows the options rotated left by r
            shown = options[r:] + options[:r]
            letters = list(LETTERS[r : len(options)] + LETTERS[:r])  # each shown option's original letter
            prompt = stem + "".join(f"\n{letter}. {option}" for letter, option in zip(LETTERS, shown))
            extra = {"round_id": r, "options": shown, "option_char": letters}
            meta = {"category": row.get("category"), "answer": answer, "n": len(options)}
            read.questions.append(Question(index, f"{prompt}\n{LETTER_INSTRUCTION}", prompt, (image,), extra, meta))
    return read


def infer_letter(text: str, options: list[str]) -> str | None:
    """The option an answer picks: exactly one option letter among its words (``.()[],:;!*#{}`` as spaces), else
    exactly one option's text inside it (case-insensitive); None when neither tells."""
    letters = LETTERS[: len(options)]
    words = text
    for ch in ".()[],:;!*#{}":
        words = words.replace(ch, " ")
    found = [c for c in letters if c in words.split()]
    if len(found) == 1:
        return found[0]
    inside = [c for c, option in zip(letters, options) if option.lower() in text.lower()]
    return inside[0] if len(inside) == 1 else None


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    rounds: dict[Any, list[bool]] = defaultdict(list)
    categories: dict[Any, str] = {}
    first_round: dict[Any, bool] = {}
    unparsed = 0
    for question, answer in answered:
        meta, r = question.meta, question.extra["round_id"]
        if meta["answer"] is None:
            continue  # no answer key (a test split): nothing to score
        letter = None if answer is None else infer_letter(answer["text"], question.extra["options"])
        unparsed += answer is not None and letter is None
        expected = LETTERS[(meta["answer"] - r) % meta["n"]]  # where the right option sits in round r
        rounds[question.question_id].append(letter == expected)
        categories[question.question_id] = meta["category"]
        if r == 0:
            first_round[question.question_id] = letter == expected
    passed = {i: all(rs) for i, rs in rounds.items()}
    per_category: dict[str, list[bool]] = defaultdict(list)
    for i, ok in passed.items():
        per_category[categories[i]].append(ok)
    n = len(passed)
    return {
        "circular_accuracy": sum(passed.values()) / n if n else 0.0,
        "single_round_accuracy": sum(first_round.values()) / len(first_round) if first_round else 0.0,
        "n": n, "unparsed": unparsed,
        "categories": {c: sum(v) / len(v) for c, v in sorted(per_category.items())},
    }  # fmt: skip
