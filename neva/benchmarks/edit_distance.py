"""Levenshtein distance (insertions, deletions, substitutions, each 1), as ANLS and MathVista's nearest-choice rule
use it."""

from __future__ import annotations


def levenshtein(a: str, b: str) -> int:
    if len(a) > len(b):
        a, b = b, a
    row = list(range(len(a) + 1))
    for j, cb in enumerate(b):
        new = [j + 1]
        for i, ca in enumerate(a):
            new.append(row[i] if ca == cb else 1 + min(row[i], row[i + 1], new[-1]))
        row = new
    return row[-1]
