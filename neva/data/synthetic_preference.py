"""The built-in synthetic preference set: the synthetic shapes' first question, its right answer preferred to a wrong
one of the same kind (another scene's answer that differs), in LLaVA-NeXT's DPO record format."""

from __future__ import annotations

from typing import Any

import numpy as np

from neva.data import synthetic

# Scenes searched for a wrong answer of the question's kind: colours, shapes and counts repeat within a few scenes.
_SEARCH = 64


def preference_record(seed: int, split: str, index: int) -> dict[str, Any]:
    """Pair ``index``: the scene's first question (its ``<image>`` turn), the right answer and a wrong one."""
    qa = synthetic.make_record(seed, split, index, "qa")
    s = synthetic.scene(seed, split, index)
    rng = np.random.default_rng([seed, synthetic.SPLITS[split], index, 1])
    kind = s.kinds()[int(rng.permutation(len(s.kinds()))[0])]  # make_record's first kind: the same draw
    right = s.answer(kind)
    wrong = next(a for j in range(1, _SEARCH) if (a := synthetic.scene(seed, split, index + j).answer(kind)) != right)
    prompt = qa["conversations"][0]["value"]
    return {"id": f"pref-{qa['id']}", "image": qa["image"], "prompt": prompt, "chosen": right, "rejected": wrong}


def preference_records(seed: int, split: str, num_samples: int, task: str) -> list[dict[str, Any]]:
    """``num_samples`` pairs of ``split`` (``task`` is ignored: every pair is a question)."""
    return [preference_record(seed, split, i) for i in range(num_samples)]
