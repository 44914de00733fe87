"""The skills suite as preference pairs (the quality canary's DPO stage): a skill question's right answer preferred to
a wrong answer of the same kind, in LLaVA-NeXT's DPO record format.

Pair ``k`` of a split is the ``k``-th sample of ``neva.data.synthetic_skills`` (same seed and split) that has an
image: the ``text`` skill's sums have none, and the preference stage trains image-grounded replies (``no_image``).
The prompt is the sample's first question with its ``<image>`` tags, as finetuning renders it; its images keep the
suite's names (``SkillImages`` draws them). The wrong answer is drawn from the question's own answer set
(``ALTERNATIVES``): another count of 5–9, the other of yes / no and first / second, another of the colours or shapes
a binding question asks about.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from neva.constants import IMAGE_TOKEN
from neva.data.synthetic import COLORS, SHAPES, SPLITS
from neva.data.synthetic_skills import DIGITS, image_name, skill_sample

# Each image skill's possible answers, one group per question form (a binding question asks a colour or a shape).
ALTERNATIVES: dict[str, tuple[tuple[str, ...], ...]] = {
    "count": (DIGITS[5:10],),
    "relation": (("yes", "no"),),
    "binding": (tuple(COLORS), SHAPES),
    "compare": (("first", "second"),),
}
_SALT = 37  # keeps the wrong answers' stream apart from the suite's


def wrong_answer(seed: int, split: str, index: int, skill: str, answer: str) -> str:
    """A wrong answer to sample ``index``'s question, uniform over the rest of its answer group (deterministic)."""
    group = next(g for g in ALTERNATIVES[skill] if answer in g)
    others = [a for a in group if a != answer]
    return others[int(np.random.default_rng([seed, SPLITS[split], index, _SALT]).integers(len(others)))]


def _image_indices(seed: int, split: str) -> Iterator[int]:
    index = 0
    while True:
        if skill_sample(seed, split, index).scenes:
            yield index
        index += 1


def preference_record(seed: int, split: str, index: int) -> dict[str, Any]:
    """The pair of skills sample ``index`` (one with images): its first question, right answer and a wrong one."""
    s = skill_sample(seed, split, index)
    return {
        "id": f"skills-pref-{split}-{index}",
        "image": [image_name("qa", split, index, k) for k in range(len(s.scenes))],
        "prompt": f"{IMAGE_TOKEN}\n" * len(s.scenes) + s.question,
        "chosen": s.answer,
        "rejected": wrong_answer(seed, split, index, s.skill, s.answer),
    }


def skills_preference_records(seed: int, split: str, num_samples: int, task: str) -> list[dict[str, Any]]:
    """``num_samples`` pairs of ``split`` (``task`` is ignored: every pair is a question)."""
    indices = _image_indices(seed, split)
    return [preference_record(seed, split, next(indices)) for _ in range(num_samples)]
