"""AI2D (test): the option letter, as lmms-eval 0.7.3 scores ``ai2d`` and ``ai2d_no_mask``
(``lmms_eval/tasks/ai2d/``): the two differ only in their images. ``ai2d`` is AI2D's release, whose diagrams have
their text labels masked by letters (``lmms-lab/ai2d``); ``ai2d_no_mask`` the same questions with the labels left in
(``Efficient-Large-Model/ai2d-no-mask``). Reported numbers differ between the two: say which one.

Files: the dataset's Hugging Face snapshot: ``test`` parquet files, columns ``question``, ``options`` (a list),
``answer`` (the right option's index, as text), ``image``.

Prompt (``ai2d.yaml``, ``default``: ``prompt_format: mcq``): the question, ``\\nA. …`` options, then
``\\nAnswer with the option's letter from the given choices directly.``; 16 new tokens.

Scoring (the ``flexible-extract`` filter, then ``exact_match`` with ``ignore_case`` and ``ignore_punctuation``): an
answer starting with a letter and a period (``  B. …``) is that letter; any other answer is compared whole. Right when
it equals the answer's letter lower-cased with ASCII punctuation removed (so ``(b)`` and ``B!`` are right, ``B is
right`` is not).
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean, mean_stderr

POST_PROMPT = "\nAnswer with the option's letter from the given choices directly."
LEADING_LETTER = re.compile(r"^\s*([A-Z])\.")
NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


def prompt(doc: dict[str, Any]) -> str:
    options = "\n".join(f"{chr(ord('A') + i)}. {choice}" for i, choice in enumerate(doc["options"]))
    return f"{doc['question']}\n{options}{POST_PROMPT}"


def read(folder: Path) -> Read:
    read = Read([])
    for i, doc in enumerate(read_rows(split_files(folder, "test"))):
        text = prompt(doc)
        meta = {"options": list(doc["options"]), "answer": doc["answer"]}
        read.questions.append(Question(i, text, text, (doc["image"],), meta=meta))
    return read


def target(doc: dict[str, Any]) -> str:
    return chr(ord("A") + int(doc["answer"]))


def right(doc: dict[str, Any], text: str) -> float:
    match = LEADING_LETTER.match(text)
    picked = (match.group(1) if match else text).strip()

    def plain(s: str) -> str:
        return s.lower().translate(NO_PUNCTUATION)

    return 1.0 if plain(picked) == plain(target(doc)) else 0.0


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    scores = [right(doc, text) for doc, text in pairs]
    return {"exact_match": mean(scores), "exact_match_stderr": mean_stderr(scores), "n": len(scores)}


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
