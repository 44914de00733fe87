"""The built-in verifiable prompts of the online RL stage: the synthetic shapes' questions (colour, shape, count,
position) with the answer the scene knows, in the LLaVA-style prompt format (``neva.data.grpo_prompts``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from neva.data import synthetic


def grpo_record(seed: int, split: str, index: int) -> dict[str, Any]:
    """Prompt ``index``: one of the scene's questions (drawn per scene) and its one-or-two-word answer."""
    s = synthetic.scene(seed, split, index)
    rng = np.random.default_rng([seed, synthetic.SPLITS[split], index, 2])
    kinds = s.kinds()
    kind = kinds[int(rng.integers(len(kinds)))]
    return {"id": f"grpo-synthetic-{split}-{index}", "image": synthetic.image_name(split, index),
            "problem": s.question(kind), "answer": s.answer(kind), "kind": kind}  # fmt: skip


def grpo_records(seed: int, split: str, num_samples: int, task: str) -> list[dict[str, Any]]:
    """``num_samples`` prompts of ``split`` (``task`` is ignored: every prompt is a question)."""
    return [grpo_record(seed, split, i) for i in range(num_samples)]
