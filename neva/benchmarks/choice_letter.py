"""Which option letter a free-form answer picks: lmms-eval 0.7.3's shared extractor
(``lmms_eval/tasks/_task_utils/mcq_extract.py``, ``extract_mcq_answer``), which MMStar and RealWorldQA score with.

Every place a choice letter can stand is a candidate, ranked by how sure the format is: the answer starting with a
standalone letter (10), ending with one (9), after an answer phrase (``the answer is``, 7), ``(A)`` (6), ``A.`` (5),
``A:`` (4), ``A)`` (3), ``A `` (2); any occurrence at all only when nothing else matched (0). The highest rank wins,
the last position within it.
"""

from __future__ import annotations

DEFAULT_CHOICES = ("A", "B", "C", "D", "E", "F", "G", "H")

ANSWER_PHRASES = (
    "the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is",
    "best answer is", "the correct option is", "correct option is", "the best option is", "best option is",
    "the choice is", "choice is", "the correct choice is", "correct choice is", "i choose", "i select", "i pick",
    "my answer is", "my choice is", "옵션", "정답은", "답은", "답:", "答案是", "答案为", "选", "答えは",
)  # fmt: skip

# (format, rank, text around the letter) for the formats found by substring
MARKED = (("parentheses", 6, "({})"), ("period", 5, "{}."), ("colon", 4, "{}:"), ("right_paren", 3, "{})"),
          ("space", 2, "{} "))  # fmt: skip
PHRASE, START, END, FALLBACK = 7, 10, 9, 0


def extract_choice(response: str, choices: tuple[str, ...] | list[str] | None = None) -> str:
    """The letter ``response`` picks among ``choices`` (A..H by default); ``""`` when none appears."""
    if not response or not response.strip():
        return ""
    letters = list(choices or DEFAULT_CHOICES)
    text = response.strip()
    for char in (",", ".", "!", "?", ";", ":", "'", '"'):
        text = text.strip(char)
    text = f" {text} "  # a letter at either end stands alone
    candidates: list[tuple[int, int, str]] = []  # (rank, position, letter)
    for _, rank, pattern in MARKED:
        for letter in letters:
            mark = pattern.format(letter)
            if mark in text:
                candidates.append((rank, text.rfind(mark), letter))
    lower = text.lower()
    for phrase in ANSWER_PHRASES:
        at = lower.find(phrase)
        if at != -1:
            for letter in letters:  # the first occurrence of each letter after the phrase
                position = text.find(letter, at + len(phrase))
                if position != -1:
                    candidates.append((PHRASE, position, letter))
    stripped = text.strip()
    for letter in letters:
        if stripped.startswith(letter) and (len(stripped) == 1 or not stripped[1].isalpha()):
            candidates.append((START, 0, letter))
    for letter in letters:
        if stripped.endswith(letter) and (len(stripped) == 1 or not stripped[-2].isalpha()):
            candidates.append((END, len(text) - 1, letter))
    if not candidates:
        candidates = [(FALLBACK, text.rfind(letter), letter) for letter in letters if letter in text]
    if not candidates:
        return ""
    # lmms-eval sorts by (rank, position), descending, with a stable sort: among equal keys the first appended wins
    return sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True)[0][2]
