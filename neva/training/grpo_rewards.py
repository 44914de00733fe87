"""The online RL stage's rewards: built-in verifiable ones and user functions, weighted and summed per completion.

``model.grpo.rewards`` lists ``{function, weight}``: a built-in name (``BUILTIN``) or a user function by dotted path
``package.module:function``, called as ``function(prompt, completion, record)`` (the prompt's text, the completion's
decoded text, the dataset record as read) and returning a float, or None where it cannot score the completion (as in
TRL, a completion no function scores is left out of its group's baseline and takes advantage 0). A completion's reward
is the weighted sum of its functions' values (None counting 0); every function's mean and std go to the metrics.

Built-ins (the recipe of EasyR1's ``examples/reward_function/math.py`` is ``accuracy`` 0.9 + ``format`` 0.1):

- ``accuracy``: 1 where the completion's final answer matches the record's (``answer`` / ``solution``), else 0. The
  final answer is the ``<answer>…</answer>`` text, else the last ``\\boxed{…}``, else what follows ``</think>``,
  else the whole completion. A gold answer that is one choice letter (A–J) matches the answer's first standalone
  letter; a number matches the answer's last number (relative tolerance 1e-6); LaTeX (``\\``, ``^``, ``{``) is
  checked by ``math-verify`` (parse both, ``verify``); any other string by equality after normalisation (lower case,
  punctuation, articles and extra spaces dropped: the SQuAD / VQA rule).
- ``format``: 1 where the completion is ``<think>…</think>`` followed by a non-empty answer, else 0.
- ``length``: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) over the completion's tokens L with
  L_max = ``max_new_tokens`` and a cache of L_max / 4: 0 up to L_max − cache, then falling linearly to −1 at L_max.
"""

from __future__ import annotations

import importlib
import math
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from neva.errors import ConfigError

ANSWER_KEYS = ("answer", "solution")  # LLaVA-style records, TRL's
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_CHOICE = re.compile(r"^\(?([A-J])\)?[.:)]?$")


def gold_answer(record: dict[str, Any]) -> str | None:
    """The record's checkable answer (``answer``, else TRL's ``solution``), as text; None where it has none."""
    for key in ANSWER_KEYS:
        value = record.get(key)
        if value is not None:
            return str(value)
    return None


def final_answer(completion: str) -> str:
    """The part of a completion that states its answer (see the module docstring)."""
    tagged = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    if "</think>" in completion:
        return completion.rsplit("</think>", 1)[1].strip()
    return completion.strip()


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def normalize(text: str) -> str:
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def _number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _choice(text: str) -> str | None:
    for token in re.findall(r"\(?\b[A-J]\b\)?[.:)]?", text):
        m = _CHOICE.match(token)
        if m:
            return m.group(1)
    return None


def answers_match(gold: str, answer: str) -> bool:
    """Whether ``answer`` (a completion's final answer) states ``gold`` (see the module docstring)."""
    gold = gold.strip()
    if _CHOICE.match(gold):
        return _choice(answer) == _CHOICE.match(gold).group(1)
    if re.fullmatch(r"\s*" + _NUMBER.pattern + r"\s*", gold):
        value = _number(answer)
        return value is not None and math.isclose(value, float(gold.replace(",", "")), rel_tol=1e-6, abs_tol=1e-9)
    if any(c in gold for c in "\\^{"):
        from math_verify import parse, verify

        boxed = lambda s: s if "\\boxed" in s or "$" in s else f"${s}$"  # noqa: E731
        return bool(verify(parse(boxed(gold)), parse(boxed(answer))))
    return normalize(answer) == normalize(gold)


def accuracy(prompt: str, completion: str, record: dict[str, Any], **_: Any) -> float | None:
    gold = gold_answer(record)
    if gold is None:
        return None
    return float(answers_match(gold, final_answer(completion)))


_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*\S.*$", flags=re.DOTALL)


def think_format(prompt: str, completion: str, record: dict[str, Any], **_: Any) -> float:
    return float(bool(_FORMAT.match(completion)))


def overlong(
    prompt: str,
    completion: str,
    record: dict[str, Any],
    *,
    completion_ids: Sequence[int],
    max_new_tokens: int,
    **_: Any,
) -> float:
    cache = max(1, max_new_tokens // 4)
    free = max_new_tokens - cache
    n = len(completion_ids)
    if n <= free:
        return 0.0
    return max(-1.0, (free - n) / cache)


# name -> (function, whether it takes the completion's ids and max_new_tokens)
BUILTIN: dict[str, tuple[Callable[..., float | None], bool]] = {
    "accuracy": (accuracy, False),
    "format": (think_format, False),
    "length": (overlong, True),
}


@dataclass
class Reward:
    name: str
    function: Callable[..., float | None]
    weight: float
    takes_ids: bool = False


def load_rewards(specs: Sequence[Any]) -> list[Reward]:
    """``model.grpo.rewards`` as callables.

    Raises:
        ConfigError: a name that is neither a built-in nor ``module:function``, a module that does not import, or
            a name it does not have.
    """
    out = []
    for i, spec in enumerate(specs):
        key = f"model.grpo.rewards[{i}].function"
        if spec.function in BUILTIN:
            fn, takes_ids = BUILTIN[spec.function]
            out.append(Reward(spec.function, fn, spec.weight, takes_ids))
            continue
        module, sep, name = spec.function.partition(":")
        if not sep or not module or not name:
            raise ConfigError(f"{key}={spec.function!r}: a built-in ({', '.join(BUILTIN)}) or module:function")
        try:
            fn = getattr(importlib.import_module(module), name)
        except ImportError as err:
            raise ConfigError(f"{key}={spec.function!r}: cannot import {module}: {err}") from err
        except AttributeError as err:
            raise ConfigError(f"{key}={spec.function!r}: {module} has no {name}") from err
        out.append(Reward(spec.function, fn, spec.weight))
    return out


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[str],
    completions: Sequence[str],
    records: Sequence[dict[str, Any]],
    completion_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each function's value per completion ``[N, F]``, NaN where it returned None; the weighted total ``[N]``, NaN
    where no function scored the completion)."""
    values = torch.full((len(completions), len(rewards)), float("nan"))
    for j, reward in enumerate(rewards):
        extra = {"completion_ids": None, "max_new_tokens": max_new_tokens} if reward.takes_ids else {}
        for i, (prompt, completion, record) in enumerate(zip(prompts, completions, records)):
            if reward.takes_ids:
                extra["completion_ids"] = completion_ids[i]
            value = reward.function(prompt, completion, record, **extra)
            if value is not None:
                values[i, j] = float(value)
    weights = torch.tensor([r.weight for r in rewards])
    total = (values.nan_to_num(0.0) * weights).sum(1)
    total[values.isnan().all(1)] = float("nan")
    return values, total


def reward_metrics(rewards: Sequence[Reward], values: torch.Tensor, total: torch.Tensor) -> dict[str, float]:
    """``reward`` (mean, std of the weighted totals) and ``rewards/<name>/mean`` / ``std`` per function, over the
    completions each scored (TRL's names)."""

    def stats(x: torch.Tensor) -> tuple[float, float]:
        x = x[~x.isnan()]
        if not x.numel():
            return float("nan"), float("nan")
        return float(x.mean()), float(x.std()) if x.numel() > 1 else 0.0

    out = dict(zip(("reward", "reward_std"), stats(total)))
    for j, reward in enumerate(rewards):
        out[f"rewards/{reward.name}/mean"], out[f"rewards/{reward.name}/std"] = stats(values[:, j])
    return out
