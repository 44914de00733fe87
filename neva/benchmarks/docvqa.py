"""DocVQA and InfographicVQA: ANLS on the validation split, the upload file for the test split's server, as lmms-eval
0.7.3 runs ``docvqa_val`` / ``docvqa_test`` / ``infovqa_val`` / ``infovqa_test`` (``lmms_eval/tasks/docvqa/``,
``infovqa/``; the metric ``anls`` in ``lmms_eval/api/metrics.py``, from Qwen-VL's ``infographicsvqa_eval.py``).

Files: the Hugging Face snapshot of ``lmms-lab/DocVQA``: ``DocVQA/`` and ``InfographicVQA/`` (its two configs), each
with ``validation`` and ``test`` parquet files, columns ``questionId``, ``question``, ``answers`` (a list; none in
test), ``image``.

Prompt (``_default_template_docvqa_yaml``, ``default``): the question, then ``\\nAnswer the question using a single word
or phrase.``; 32 new tokens.

ANLS: per accepted answer, the Levenshtein distance between it and the answer, both stripped, lower-cased and with
runs of whitespace as one space, divided by the longer of the two as given (not normalised: lmms-eval's, and
Qwen-VL's, lengths); one minus the smallest; below 0.5 it is 0. The score is the mean over questions. The test split:
``<split>_test_upload.json``, ``[{"questionId": int, "answer": text}]`` as lmms-eval writes it for the RRC server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neva.benchmarks.edit_distance import levenshtein
from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean, mean_stderr

POST_PROMPT = "\nAnswer the question using a single word or phrase."
THRESHOLD = 0.5


def prompt(doc: dict[str, Any]) -> str:
    return f"{doc['question']}{POST_PROMPT}"


def subset_root(folder: Path, subset: str) -> Path:
    """The config's folder: under the snapshot (``--data-dir`` holding it, or the snapshot itself), or beside the
    folder given (the snapshot's ``DocVQA/`` config folder found first, InfographicVQA asked)."""
    for root in (folder / subset, folder.parent / subset):
        if root.is_dir():
            return root
    return folder / subset


def reader(subset: str, split: str):
    """The reader of one config's split (``DocVQA`` / ``InfographicVQA``, ``validation`` / ``test``)."""

    def read(folder: Path) -> Read:
        read = Read([])
        for doc in read_rows(split_files(subset_root(folder, subset), split)):
            text = prompt(doc)
            meta = {"answers": doc.get("answers") or []}
            read.questions.append(Question(int(doc["questionId"]), text, text, (doc["image"],), meta=meta))
        return read

    return read


def anls(answers: list[str], prediction: str) -> float:
    """One question's ANLS (``lmms_eval.api.metrics.anls``)."""
    values = []
    for answer in answers:
        gold = " ".join(answer.strip().lower().split())
        mine = " ".join(prediction.strip().lower().split())
        length = max(len(answer.upper()), len(prediction.upper()))
        values.append(0.0 if length == 0 else levenshtein(gold, mine) / length)
    if not values:  # no accepted answer (lmms-eval stops there)
        return 0.0
    value = 1 - min(values)
    return 0 if value < THRESHOLD else value


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    scores = [anls(doc["answers"], text) for doc, text in pairs]
    return {"anls": mean(scores), "anls_stderr": mean_stderr(scores), "n": len(scores)}


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])


def uploader(name: str):
    """The scorer of a test split: its upload file ``<name>_upload.json``."""

    def score_test(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
        upload = [{"questionId": int(q.question_id), "answer": a["text"]} for q, a in answered if a is not None]
        path = out / f"{name}_upload.json"
        path.write_text(json.dumps(upload))
        return {"upload_file": str(path), "n": len(answered), "answered": len(upload)}

    return score_test
