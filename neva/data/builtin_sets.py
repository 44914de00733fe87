"""The built-in generated data sets a ``model.data.data_path`` entry may name instead of a file.

Each is a pair of pure functions of the seed: ``records(seed, split, num_samples, task)`` (LLaVA-format dicts,
``split`` ``train`` or ``val``, ``task`` ``caption`` or ``qa``) and ``images(seed, image_size)`` (a picklable name →
PIL image function for the records' image names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from neva.data import synthetic, synthetic_detail, synthetic_skills


@dataclass(frozen=True)
class BuiltinSet:
    records: Callable[[int, str, int, str], list[dict[str, Any]]]
    images: Callable[[int, int], Callable[[str], Any]]


BUILTIN_SETS: dict[str, BuiltinSet] = {
    "synthetic": BuiltinSet(synthetic.synthetic_records, synthetic.SyntheticImages),  # coloured shapes (saturates)
    "synthetic_skills": BuiltinSet(synthetic_skills.skills_records, synthetic_skills.SkillImages),  # the canary's
    # fine patterns in images twice the tower's size: what AnyRes tiles resolve and a fixed resolution cannot
    "synthetic_detail": BuiltinSet(synthetic_detail.detail_records, synthetic_detail.DetailImages),
}
