"""The built-in generated data sets a ``model.data.data_path`` entry may name instead of a file.

Each is a pair of pure functions of the seed: ``records(seed, split, num_samples, task)`` (LLaVA-format dicts,
``split`` ``train`` or ``val``, ``task`` ``caption`` or ``qa``) and ``images(seed, image_size)`` (a picklable name →
PIL image function for the records' image names; None: the set has no images). A set with videos also has
``videos(seed, records, folder)``, which writes the records' video files under ``folder`` (``model.data.video_folder``,
else the set's ``video_folder(seed)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from neva.data import (
    synthetic,
    synthetic_detail,
    synthetic_grpo,
    synthetic_preference,
    synthetic_skills,
    synthetic_skills_preference,
    synthetic_video,
)


@dataclass(frozen=True)
class BuiltinSet:
    records: Callable[[int, str, int, str], list[dict[str, Any]]]
    images: Callable[[int, int], Callable[[str], Any]] | None
    videos: Callable[[int, list[dict[str, Any]], str], None] | None = None
    video_folder: Callable[[int], str] | None = None


BUILTIN_SETS: dict[str, BuiltinSet] = {
    "synthetic": BuiltinSet(synthetic.synthetic_records, synthetic.SyntheticImages),  # coloured shapes (saturates)
    "synthetic_skills": BuiltinSet(synthetic_skills.skills_records, synthetic_skills.SkillImages),  # the canary's
    # a moving, colour-changing shape as mp4 clips: questions one frame cannot answer
    "synthetic_video": BuiltinSet(
        synthetic_video.video_records, None, synthetic_video.write_videos, synthetic_video.default_folder
    ),
    # fine patterns in images twice the tower's size: what AnyRes tiles resolve and a fixed resolution cannot
    "synthetic_detail": BuiltinSet(synthetic_detail.detail_records, synthetic_detail.DetailImages),
    # the shapes' first question, the right answer preferred to a wrong one (the DPO stage's default data)
    "synthetic_preference": BuiltinSet(synthetic_preference.preference_records, synthetic.SyntheticImages),
    # the shapes' questions with the answers the scenes know: the online RL stage's verifiable prompts
    "synthetic_grpo": BuiltinSet(synthetic_grpo.grpo_records, synthetic.SyntheticImages),
    # the skills suite's image questions, the right answer preferred to a wrong one (the canary's DPO stage)
    "synthetic_skills_preference": BuiltinSet(
        synthetic_skills_preference.skills_preference_records, synthetic_skills.SkillImages
    ),
}
