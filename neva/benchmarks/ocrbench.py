"""OCRBench: substring matching per category, a score out of 1000, as lmms-eval 0.7.3 scores ``ocrbench``
(``lmms_eval/tasks/ocrbench/utils.py``).

Files: the Hugging Face snapshot of ``echo840/OCRBench``: ``test`` parquet files, columns ``dataset`` (the source),
``question``, ``question_type`` (one of the ten categories), ``answer`` (a list of accepted answers), ``image``.

Prompt (``ocrbench.yaml``, ``default``): the question stripped, nothing added; 128 new tokens.

Scoring: a question scores 1 when an accepted answer is inside the answer (both stripped, newlines as spaces). For
HME100k (handwritten formulas) every space is removed from both first; for the rest both are lower-cased, and
full-width ASCII (U+FF01-U+FF5E) and the ideographic space folded to ASCII. The score is the number right out of 1000
(``final_score``; ``accuracy`` = that / 1000, lmms-eval's ``ocrbench_accuracy``), with the text-recognition total (the
six recognition categories) and each category's count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean_stderr

RECOGNITION = ("Regular Text Recognition", "Irregular Text Recognition", "Artistic Text Recognition",
               "Handwriting Recognition", "Digit String Recognition", "Non-Semantic Text Recognition")  # fmt: skip
CATEGORIES = (*RECOGNITION, "Scene Text-centric VQA", "Doc-oriented VQA", "Key Information Extraction",
              "Handwritten Mathematical Expression Recognition")  # fmt: skip
SCORED = ("dataset", "question_type", "answer")


def prompt(doc: dict[str, Any]) -> str:
    return doc["question"].strip()


def read(folder: Path) -> Read:
    read = Read([])
    for i, doc in enumerate(read_rows(split_files(folder, "test"))):
        text = prompt(doc)
        read.questions.append(Question(i, text, text, (doc["image"],), meta={k: doc[k] for k in SCORED}))
    return read


def fold_fullwidth(text: str) -> str:
    """Full-width ASCII and the ideographic space as ASCII (nothing else of NFKC)."""
    return "".join(chr(ord(c) - 0xFEE0) if 0xFF01 <= ord(c) <= 0xFF5E else " " if ord(c) == 0x3000 else c for c in text)


def right(doc: dict[str, Any], text: str) -> int:
    prediction = text.strip()
    answers = doc["answer"] if isinstance(doc["answer"], list) else [doc["answer"]]
    if doc["dataset"] == "HME100k":

        def plain(s: str) -> str:
            return s.strip().replace("\n", " ").replace(" ", "")
    else:

        def plain(s: str) -> str:
            return fold_fullwidth(s).lower().strip().replace("\n", " ")

    return int(any(plain(a) in plain(prediction) for a in answers))


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    counts = dict.fromkeys(CATEGORIES, 0)
    scores = []
    for doc, text in pairs:
        s = right(doc, text)
        counts[doc["question_type"]] = counts.get(doc["question_type"], 0) + s
        scores.append(s)
    final = sum(counts[c] for c in CATEGORIES)  # a question of another category is counted apart, not scored
    stderr = mean_stderr(scores)
    return {"final_score": final, "accuracy": final / 1000, "accuracy_stderr": stderr,
            "text_recognition": sum(counts[c] for c in RECOGNITION), "categories": counts, "n": len(scores)}  # fmt: skip


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
