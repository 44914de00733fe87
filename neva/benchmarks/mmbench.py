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
from neva.benchmarks.xlsx import write_xlsx

DEV_FILE = "mmbench_dev_20230712.tsv"
TEST_FILE = "mmbench_test_20230712.tsv"
UPLOAD_FILE = "mmbench_test_upload.xlsx"
# What convert_mmbench_for_submission.py drops from the TSV before inserting its ``prediction`` column at position 6
DROPPED = ("hint", "category", "source", "image", "comment", "l2-category")
LETTERS = ("A", "B", "C", "D")


def _absent(value: str | None) -> bool:
    """model_vqa_mmbench's ``is_none``: an empty cell (what pandas reads as NaN), or ``nan`` / ``none`` written out."""
    return value is None or value.lower() in ("", "nan", "none")


def read(folder: Path) -> Read:
    return _read(folder / DEV_FILE, all_rounds=True)


def read_test(folder: Path) -> Read:
    """The test split as LLaVA's ``scripts/v1_5/eval/mmbench.sh`` asks it: one round per row (no ``--all-rounds``),
    the options in the file's order."""
    return _read(folder / TEST_FILE, all_rounds=False)


def _read(path: Path, all_rounds: bool) -> Read:
    read = Read([])
    for row in load_tsv(need(path)):
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
        for r in range(len(options) if all_rounds else 1):  # round r shows the options rotated left by r
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


def score_test(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    """The server's upload, as LLaVA's ``scripts/convert_mmbench_for_submission.py`` writes it: the TSV's rows in
    order without the ``DROPPED`` columns (those present), a ``prediction`` column inserted at position 6 holding each
    row's answer text (empty where none), ``index`` as an integer (pandas reads it so), other cells as text, an
    absent value (empty, ``nan``) as an empty cell."""
    rows = load_tsv(need(folder / TEST_FILE))
    texts = {a["question_id"]: a["text"] for _, a in answered if a is not None}
    columns = [c for c in (rows[0].keys() if rows else []) if c not in DROPPED]
    header = [*columns[:6], "prediction", *columns[6:]]

    def cell(column: str, value: str | None) -> str | int | None:
        if column == "index":
            return int(value)
        return None if _absent(value) else value

    table = []
    for row in rows:
        cells = [cell(c, row.get(c)) for c in columns]
        table.append([*cells[:6], texts.get(int(row["index"])), *cells[6:]])
    path = write_xlsx(out / UPLOAD_FILE, header, table)
    return {"upload_file": str(path), "n": len(table), "answered": len(texts)}
