"""The VQA answer normalisation of the EvalAI servers (VQAv2, VizWiz) and of TextVQA's ``m4c_evaluator``.

The rule, step by step, as LLaVA's ``llava/eval/m4c_evaluator.py`` (``EvalAIAnswerProcessor``, itself MMF's copy of the
official VQA evaluation) applies it: lower-case, drop commas and question marks, split ``'s``; strip; punctuation
dropped or turned into a space; periods not before a digit dropped (at most 32: the official code passes
``re.UNICODE`` where ``re.sub`` takes its count); number words to digits; articles dropped; contractions restored.
"""

from __future__ import annotations

import re

_CONTRACTED_WORDS = (
    "ain't aren't can't could've couldn't couldn't've didn't doesn't don't hadn't hadn't've hasn't haven't he'd he'd've "
    "he's how'd how'll how's I'd've I'm I've isn't it'd it'd've it'll ma'am mightn't mightn't've might've mustn't "
    "must've needn't not've o'clock oughtn't 'ow's'at shan't she'd've should've shouldn't shouldn't've somebody'd've "
    "somebody'll somebody's someone'd someone'd've someone'll someone's something'd something'd've something'll "
    "that's there'd there'd've there're there's they'd they'd've they'll they're they've 'twas wasn't we'd've we've "
    "weren't what'll what're what's what've when's where'd where's where've who'd who'd've who'll who's who've why'll "
    "why're why's won't would've wouldn't wouldn't've y'all y'all'll y'all'd've you'd you'd've you'll you're you've"
)
_CONTRACTED = _CONTRACTED_WORDS.split()  # the contractions the table restores, as words


def _spellings(word: str) -> list[str]:
    """The official table's misspellings of a contraction: one apostrophe left out (every apostrophe, for one)."""
    marks = [i for i, ch in enumerate(word) if ch == "'"]
    if len(marks) == 1:
        return [word.replace("'", "")]
    return [word[:i] + word[i + 1 :] for i in marks]


CONTRACTIONS = {spelling: word for word in _CONTRACTED for spelling in _spellings(word)}
CONTRACTIONS["somebody'd"] = "somebodyd"  # the official table's one entry that runs backwards
NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
           "seven": "7", "eight": "8", "nine": "9", "ten": "10"}  # fmt: skip
ARTICLES = frozenset(("a", "an", "the"))
PUNCTUATION = ';/[]"{}()=+\\_-><@`,?!'
_PERIOD = re.compile(r"\.(?!\d)")
_DIGIT_COMMA = re.compile(r"(?<=\d),+(?=\d)")


def _punctuation(text: str) -> str:
    """Each mark dropped where it touches a space (or anywhere, once a comma sits between digits), else a space."""
    out = text
    digit_comma = _DIGIT_COMMA.search(text) is not None
    for mark in PUNCTUATION:
        dropped = digit_comma or mark + " " in text or " " + mark in text
        out = out.replace(mark, "" if dropped else " ")
    return _PERIOD.sub("", out, count=32)


def normalize_vqa_answer(answer: str) -> str:
    """``answer`` as the VQA / TextVQA scorers compare it."""
    text = answer.lower().replace(",", "").replace("?", "").replace("'s", " 's").strip()
    text = _punctuation(text.replace("\n", " ").replace("\t", " ").strip())
    words = [NUMBERS.get(w, w) for w in text.lower().split()]
    return " ".join(CONTRACTIONS.get(w, w) for w in words if w not in ARTICLES)


def vqa_soft_score(prediction: str, references: list[str]) -> float:
    """TextVQA's soft accuracy of one prediction: over the ten leave-one-out subsets of the human answers,
    min(1, matches / 3), averaged (matches compared after ``normalize_vqa_answer``)."""
    pred = normalize_vqa_answer(prediction)
    refs = [normalize_vqa_answer(r) for r in references]
    if pred not in refs:
        return 0.0
    return sum(min(1.0, sum(r == pred for j, r in enumerate(refs) if j != i) / 3) for i in range(len(refs))) / len(refs)
