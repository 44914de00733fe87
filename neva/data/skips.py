"""Skip accounting: per-reason counts from batches become metrics, and too many skips stop the run."""

from __future__ import annotations

from collections import Counter
from typing import Any


class DataQualityError(RuntimeError):
    """More than ``max_skip_fraction`` of the samples seen were skipped."""


class SkipTracker:
    """Accumulates ``batch["skipped"]`` / ``batch["num_samples"]`` and enforces ``max_skip_fraction``.

    Args:
        max_skip_fraction: allowed fraction of skipped samples.
        min_samples: samples to see before the rule applies (one bad record in the first batch must not stop a run).
    """

    def __init__(self, max_skip_fraction: float = 0.01, min_samples: int = 200) -> None:
        self.max_skip_fraction = max_skip_fraction
        self.min_samples = min_samples
        self.skipped: Counter[str] = Counter()
        self.used = 0

    @property
    def seen(self) -> int:
        """Samples seen (used + skipped)."""
        return self.used + sum(self.skipped.values())

    @property
    def fraction(self) -> float:
        """Skipped / seen."""
        return sum(self.skipped.values()) / self.seen if self.seen else 0.0

    def update(self, batch: dict[str, Any]) -> None:
        """Count one batch, then check the rule."""
        self.skipped.update(batch.get("skipped", {}))
        self.used += int(batch.get("num_samples", 0))
        if self.seen >= self.min_samples:
            self.check()

    def check(self) -> None:
        """Raise ``DataQualityError`` with a per-reason report when over the limit."""
        if self.fraction > self.max_skip_fraction:
            raise DataQualityError(
                f"{sum(self.skipped.values())} of {self.seen} samples skipped ({self.fraction:.2%} > "
                f"model.data.max_skip_fraction {self.max_skip_fraction:.2%}); by reason: {self.report()}. "
                "Fix the data (run `python -m neva.data.preview --json` to see which records) or raise the limit."
            )

    def report(self) -> str:
        """``reason=count`` pairs, most frequent first."""
        return ", ".join(f"{r}={n}" for r, n in self.skipped.most_common()) or "none"

    def metrics(self, prefix: str = "data/skipped") -> dict[str, float]:
        """Cumulative counts per reason plus the fraction, for the logger."""
        out = {f"{prefix}/{reason}": float(n) for reason, n in self.skipped.items()}
        out[f"{prefix}_fraction"] = self.fraction
        return out

    def state_dict(self) -> dict[str, Any]:
        """Counts so far (resumed runs keep counting from them)."""
        return {"skipped": dict(self.skipped), "used": self.used}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts."""
        self.skipped = Counter(state.get("skipped", {}))
        self.used = int(state.get("used", 0))
