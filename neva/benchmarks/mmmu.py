"""MMMU (validation): multiple choice parsed to a letter, open answers by normalised number or substring, as
lmms-eval 0.7.3 scores ``mmmu_val`` (``lmms_eval/tasks/mmmu/utils.py``, its rules from the MMMU repository's
``eval/eval_utils.py``; the letter parser in ``_task_utils/mmmu_mcq_utils.py``).

Files: the Hugging Face snapshot of ``MMMU/MMMU`` (or lmms-eval's copy ``lmms-lab-encoder/MMMU``): ``validation``
parquet files (one folder per subject, or one), columns ``id`` (``validation_<Subject>_<n>``), ``question``,
``options`` (a Python list written as a string), ``answer``, ``question_type`` (``multiple-choice`` / ``open``),
``image_1`` .. ``image_7``.

Prompt (``mmmu_val.yaml``, ``lmms_eval_specific_kwargs.default``; ``interleaved_format: false``): the question, for
multiple choice ``\\nA. …`` options, then a blank line and ``Answer with the option's letter from the given choices
directly.`` (open: ``Answer the question using a single word or phrase.``); the ``<image N>`` tags stay in the text,
the images they name go in front in tag order. 128 new tokens.

Scoring: a multiple-choice answer's letter is ``(X)``, else ``X `` / ``X.`` inside it, else (over five words) an
option's text inside it, the last one found when several are; when nothing is found lmms-eval picks a letter at random
(``random.choice``, its global generator seeded 0 by the evaluator): here a ``random.Random(0)`` drawn in question
order, the draws lmms-eval makes in one process. An open answer's key sentences (after ``is``, ``so``, ``answer``…,
``=`` in the last) and the numbers in them, normalised (numbers rounded to 2 decimals, text lower-cased, one
character padded with a space), are correct when a number equals the answer's or the answer's text is inside one.
Accuracy per subject, per domain (weighted by questions) and overall, rounded to 5 digits as lmms-eval prints them.
"""

from __future__ import annotations

import ast
import random
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from neva.benchmarks.files import Question, Read
from neva.benchmarks.hf_parquet import read_rows, split_files
from neva.benchmarks.stderr import mean_stderr

MC_PROMPT = "Answer with the option's letter from the given choices directly."
OPEN_PROMPT = "Answer the question using a single word or phrase."
SEED = 0  # lmms-eval's default --seed: Python's random seeded 0 before any task runs
DOMAINS = {
    "Art and Design": ["Art", "Art_Theory", "Design", "Music"],
    "Business": ["Accounting", "Economics", "Finance", "Manage", "Marketing"],
    "Science": ["Biology", "Chemistry", "Geography", "Math", "Physics"],
    "Health and Medicine": ["Basic_Medical_Science", "Clinical_Medicine", "Diagnostics_and_Laboratory_Medicine",
                            "Pharmacy", "Public_Health"],
    "Humanities and Social Science": ["History", "Literature", "Sociology", "Psychology"],
    "Tech and Engineering": ["Agriculture", "Architecture_and_Engineering", "Computer_Science", "Electronics",
                             "Energy_and_Power", "Materials", "Mechanical_Engineering"],
}  # fmt: skip
SCORED = ("id", "question_type", "options", "answer")


def prompt(doc: dict[str, Any]) -> str:
    """``construct_prompt`` with the default kwargs."""
    if doc["question_type"] == "multiple-choice":
        options = "\n".join(f"{chr(ord('A') + i)}. {o}" for i, o in enumerate(ast.literal_eval(doc["options"])))
        return f"{doc['question']}\n{options}\n\n{MC_PROMPT}"
    return f"{doc['question']}\n\n{OPEN_PROMPT}"


def image_columns(doc: dict[str, Any]) -> list[str]:
    """``mmmu_doc_to_visual``: the ``<image N>`` tags of the question and its options, each once, sorted."""
    tags = re.findall(r"<image \d+>", prompt(doc))
    return sorted({t.strip("<>").replace(" ", "_") for t in tags})


def read(folder: Path) -> Read:
    read = Read([])
    for doc in read_rows(split_files(folder, "validation")):
        images = tuple(doc.get(c) for c in image_columns(doc))
        if any(i is None for i in images):
            read.skipped += 1
            continue
        text = prompt(doc)
        read.questions.append(Question(doc["id"], text, text, images, meta={k: doc[k] for k in SCORED}))
    return read


def parse_choice(response: str, choices: list[str], index2ans: dict[str, str], rng: random.Random) -> str:
    """``parse_mmmu_multi_choice_response``: the letter an answer picks; a draw from ``rng`` when none is found."""
    for char in (",", ".", "!", "?", ";", ":", "'"):
        response = response.strip(char)
    response = f" {response} "
    by_letter, bracketed = True, False
    candidates = [c for c in choices if f"({c})" in response]
    bracketed = bool(candidates)
    if not candidates:
        candidates = [c for c in choices if f"{c} " in response]
    if not candidates:
        candidates = [c for c in choices if f"{c}." in response]
    if not candidates and len(response.split()) > 5:
        candidates = [c for c, text in index2ans.items() if text.lower() in response.lower()]
        by_letter = not candidates
    if not candidates:
        return rng.choice(choices)
    if len(candidates) == 1:
        return candidates[0]
    if by_letter:  # the last one written wins (np.argmax: the first of equal positions)
        marks = [response.rfind(f"({c})" if bracketed else f" {c} ") for c in candidates]
    else:
        marks = [response.lower().rfind(index2ans[c].lower()) for c in candidates]
    return candidates[marks.index(max(marks))]


def extract_numbers(text: str) -> list[str]:
    """Numbers with thousands commas, in scientific notation, then plain ones (the MMMU repository's patterns)."""
    commas = re.findall(r"-?\b\d{1,3}(?:,\d{3})+\b", text)
    scientific = re.findall(r"-?\d+(?:\.\d+)?[eE][+-]?\d+", text)
    simple = re.findall(r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])", text)
    return commas + scientific + simple


def normalize(text: str) -> list[Any]:
    """A number (commas dropped) rounded to 2 decimals; else lower-cased text, one character padded both ways."""
    text = text.strip()
    try:
        return [round(float(text.replace(",", "")), 2)]
    except ValueError:
        pass
    text = text.lower()
    return [" " + text, text + " "] if len(text) == 1 else [text]


KEY_INDICATORS = ("could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result ")


def parse_open(response: str) -> list[Any]:
    """``parse_open_response``: the normalised candidates of an open answer (key sentences and their numbers)."""
    response = response.strip().strip(".").lower()
    sentences = re.split(r"\.\s(?=[A-Z])|\n", response)
    keys = []
    for index, sentence in enumerate(sentences):
        indicators = [*KEY_INDICATORS, "="] if index == len(sentences) - 1 else list(KEY_INDICATORS)
        shortest = None
        for indicator in indicators:
            if indicator in sentence:
                tail = sentence.split(indicator)[-1].strip()
                if not shortest or len(tail) < len(shortest):
                    shortest = tail
        if shortest and shortest.strip() not in (":", ",", ".", "!", "?", ";", "'"):
            keys.append(shortest)
    if not keys:
        keys = [response]
    found = keys + [n for k in keys for n in extract_numbers(k)]
    return [value for text in found for value in normalize(text)]


def open_correct(answer: Any, candidates: list[Any]) -> bool:
    """``eval_open``: a text candidate containing a normalised answer text, or a number equal to a normalised answer."""
    golds = [v for a in answer for v in normalize(a)] if isinstance(answer, list) else normalize(answer)
    for candidate in candidates:
        if isinstance(candidate, str):
            if any(isinstance(g, str) and g in candidate for g in golds):
                return True
        elif candidate in golds:
            return True
    return False


def subject(question_id: str) -> str:
    """``validation_Art_Theory_12`` → ``Art_Theory``."""
    split = question_id.split("_")[0]
    match = re.match(rf"^{split}_(.+?)_\d+$", question_id)
    if match is None:
        raise ValueError(f"MMMU id {question_id!r} is not <split>_<subject>_<n>")
    return match.group(1)


def judge(doc: dict[str, Any], text: str, rng: random.Random) -> bool:
    """One answer right or wrong (``rng``: the draws for unparsed multiple-choice answers, in question order)."""
    if doc["question_type"] == "multiple-choice":
        options = ast.literal_eval(doc["options"])
        letters = [chr(ord("A") + i) for i in range(len(options))]
        pick = parse_choice(text, letters, dict(zip(letters, options)), rng)
        answer = doc["answer"]
        return pick in answer if isinstance(answer, list) else pick == answer
    return open_correct(doc["answer"], parse_open(text))


def score_answers(pairs: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    """``(doc, answer text)`` in question order → accuracy overall, per domain and per subject, with the standard
    error of the overall accuracy."""
    rng = random.Random(SEED)
    by_subject: dict[str, list[float]] = defaultdict(list)
    flat = []
    for doc, text in pairs:
        right = float(judge(doc, text, rng))
        by_subject[subject(doc["id"])].append(right)
        flat.append(right)

    def accuracy(scores: list[float]) -> float:
        return round(sum(scores) / len(scores), 5) if scores else 0

    subjects = {s: {"acc": accuracy(v), "num": len(v)} for s, v in by_subject.items()}
    domains = {}
    for domain, names in DOMAINS.items():
        scores = [x for name in names for x in by_subject.get(name, [])]
        domains[domain] = {"acc": accuracy(scores), "num": len(scores)}
    return {"accuracy": accuracy(flat), "accuracy_stderr": mean_stderr(flat), "n": len(flat), "domains": domains,
            "subjects": dict(sorted(subjects.items()))}  # fmt: skip


def score(folder: Path, answered: list[tuple[Question, dict | None]], out: Path) -> dict[str, Any]:
    return score_answers([(q.meta, a["text"]) for q, a in answered if a is not None])
