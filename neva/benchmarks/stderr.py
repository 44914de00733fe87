"""The standard error beside each score in ``scores.json``: lmms-eval's (since v0.6) ``<metric>_stderr_clt``, the
sample standard deviation of the per-question scores over the square root of their number
(``lmms_eval/evaluator_utils.py``, ``calculate_clt_aggregate_metric``)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_stderr(scores: Sequence[float]) -> float | None:
    """``std(scores, ddof=1) / sqrt(n)``; None under two scores (lmms-eval writes ``N/A``)."""
    n = len(scores)
    if n < 2:
        return None
    mean = sum(scores) / n
    return math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1)) / math.sqrt(n)


def mean(scores: Sequence[float]) -> float:
    """The mean; 0 for none (lmms-eval divides by zero there)."""
    return sum(scores) / len(scores) if scores else 0.0
