"""The online RL stage's rewards: each built-in on completions whose right value is stated by hand (choice letters,
numbers, boxed LaTeX checked by math-verify, normalised strings, the think format, DAPO's overlong punishment), user
functions by dotted path, weights, unscorable completions and the metrics' names (TRL's)."""

from __future__ import annotations

import math

import pytest
import torch

from neva.config import RewardSpec
from neva.errors import ConfigError
from neva.training.grpo_rewards import accuracy, load_rewards, overlong, reward_metrics, score, think_format


def shouting(prompt: str, completion: str, record: dict) -> float | None:
    """A user reward (loaded by its dotted path below): None where it cannot judge."""
    return None if not completion else float(completion.isupper())


@pytest.mark.parametrize(
    "gold,completion,expected",
    [
        ("B", "<think>the circle is left</think> (B)", 1.0),
        ("B", "<think>hmm</think> A. a square", 0.0),
        ("C", "<answer>C</answer>", 1.0),
        ("3", "There are 3 circles.", 1.0),
        ("3", "<think>2 or 3</think>I count 2", 0.0),
        ("1,250", "about 1250.0", 1.0),
        ("\\frac{1}{2}", "so the ratio is \\boxed{0.5}", 1.0),
        ("\\frac{1}{2}", "\\boxed{\\frac{2}{3}}", 0.0),
        ("x^2+1", "<answer>$1 + x^2$</answer>", 1.0),
        ("red", "<think>...</think>The Red.", 1.0),
        ("a red circle", "red circle", 1.0),
        ("red", "blue", 0.0),
    ],
)
def test_accuracy(gold, completion, expected):
    assert accuracy("q", completion, {"answer": gold}) == expected
    assert accuracy("q", completion, {"solution": gold}) == expected  # TRL's key


def test_format_length_and_user_functions():
    assert think_format("", "<think>a\nb</think> 3", {}) == 1.0
    assert think_format("", "<think>a</think>", {}) == 0.0 and think_format("", "3", {}) == 0.0
    # DAPO's overlong punishment, L_max 8, cache 2: 0 to 6 tokens, then -1/2 per token, -1 at 8
    assert [overlong("", "", {}, completion_ids=[0] * n, max_new_tokens=8) for n in (5, 6, 7, 8)] == [0, 0, -0.5, -1]
    rewards = load_rewards([RewardSpec("accuracy", 0.9), RewardSpec("format", 0.1),
                            RewardSpec("tests.training.test_grpo_rewards:shouting", 2.0)])  # fmt: skip
    completions = ["<think>x</think> 3", "NO", ""]
    records = [{"answer": "3"}, {"answer": "3"}, {}]
    values, total = score(rewards, ["q"] * 3, completions, records, [[1], [1], []], 8)
    nan = float("nan")
    torch.testing.assert_close(
        values, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [nan, 0.0, nan]]), equal_nan=True
    )
    torch.testing.assert_close(total, torch.tensor([1.0, 2.0, 0.0]))
    metrics = reward_metrics(rewards, values, total)
    assert metrics["reward"] == pytest.approx(1.0) and metrics["rewards/accuracy/mean"] == pytest.approx(0.5)
    assert metrics["rewards/tests.training.test_grpo_rewards:shouting/mean"] == pytest.approx(0.5)
    assert metrics["rewards/format/std"] == pytest.approx(float(torch.tensor([1.0, 0.0, 0.0]).std()))
    _, none_scored = score(load_rewards([RewardSpec("accuracy", 1.0)]), ["q"], ["x"], [{}], [[1]], 8)
    assert math.isnan(float(none_scored[0]))  # no function scored it: left out of its group's baseline
    for bad, message in (("nope", "module:function"), ("no_such_module_x:f", "cannot import"),
                         ("tests.training.test_grpo_rewards:missing", "has no missing")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            load_rewards([RewardSpec(bad, 1.0)])
