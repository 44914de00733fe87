"""Skip accounting: per-reason counts from batches become metrics, and too many skips stop the run.

Truncated samples (cut to the maximum length, but trained on) and samples whose leading assistant turn was dropped
(LLaVA's rule; the rest is trained on) are counted here too: not skips, but events a user must be able to see.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist

from neva.data.micro_batch import SampleCounts
from neva.errors import InputError


class DataQualityError(RuntimeError):
    """More than ``max_skip_fraction`` of the samples seen were skipped."""


class SkipLimitCertain(InputError):
    """More samples were skipped than ``max_skip_fraction`` allows of all the run will draw: the data is refused
    before the rest of the run is spent (exit status 2, as any bad input)."""


class SkipTracker:
    """Accumulates micro-batches' ``SampleCounts`` (``neva.data.micro_batch``: skipped, used, truncated, ...) and enforces
    ``max_skip_fraction``.

    Args:
        max_skip_fraction: allowed fraction of skipped samples.
        min_samples: samples to see before the rule applies (one bad record in the first batch must not stop a run).
    """

    def __init__(self, max_skip_fraction: float = 0.01, min_samples: int = 200) -> None:
        self.max_skip_fraction = max_skip_fraction
        self.min_samples = min_samples
        self.skipped: Counter[str] = Counter()
        self.used = 0
        self.truncated = 0
        self.dropped_leading_reply = 0
        self.visual_budget: Counter[str] = Counter()  # samples the visual budget changed, by action
        # Samples the whole run draws (set once its steps are planned): more skips than the limit allows of them make
        # the end-of-run check certain, and the run stops there instead of spending the rest of its compute.
        self.planned: int | None = None

    @property
    def seen(self) -> int:
        """Samples seen (used + skipped)."""
        return self.used + sum(self.skipped.values())

    @property
    def fraction(self) -> float:
        """Skipped / seen."""
        return sum(self.skipped.values()) / self.seen if self.seen else 0.0

    def update(self, counts: SampleCounts) -> None:
        """Count one batch (its ``counts``), then check the rule."""
        self.skipped.update(counts.skipped)
        self.used += int(counts.num_samples)
        self.truncated += int(counts.truncated)
        self.dropped_leading_reply += int(counts.dropped_leading_reply)
        self.visual_budget.update(counts.visual_budget)
        if self.seen >= self.min_samples:
            self.check()
        skipped = sum(self.skipped.values())
        # One process only: ranks each count their own share, and a rank stopping alone would leave the others waiting
        # in a collective; there the end-of-run check, over every rank's counts, decides.
        alone = not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
        if alone and self.planned and skipped > self.max_skip_fraction * self.planned:
            raise SkipLimitCertain(
                f"{skipped} samples skipped already, more than model.data.max_skip_fraction "
                f"{self.max_skip_fraction:.2%} of the {self.planned} the run draws; by reason: {self.report()}. Fix the "
                "data (`python -m neva.data.preview --json` shows which records) or raise the limit"
            )

    def check(self) -> None:
        """Raise ``DataQualityError`` with a per-reason report when over the limit.

        During a run only once ``min_samples`` were seen; at its end whatever the count (``neva.training.guards``).
        """
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
        """Cumulative counts per reason plus the fraction, and the truncated samples, for the logger."""
        out = {f"{prefix}/{reason}": float(n) for reason, n in self.skipped.items()}
        out[f"{prefix}_fraction"] = self.fraction
        out["data/truncated"] = float(self.truncated)
        out["data/dropped_leading_reply"] = float(self.dropped_leading_reply)
        out.update({f"data/visual_budget/{action}": float(n) for action, n in self.visual_budget.items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        """Counts so far (resumed runs keep counting from them)."""
        return {
            "skipped": dict(self.skipped),
            "used": self.used,
            "truncated": self.truncated,
            "dropped_leading_reply": self.dropped_leading_reply,
            "visual_budget": dict(self.visual_budget),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts."""
        self.skipped = Counter(state.get("skipped", {}))
        self.used = int(state.get("used", 0))
        self.truncated = int(state.get("truncated", 0))
        self.dropped_leading_reply = int(state.get("dropped_leading_reply", 0))
        self.visual_budget = Counter(state.get("visual_budget", {}))

    def merge(self, states: list[dict[str, Any]], copies: int = 1) -> None:
        """Set the counts to the sum of ``states`` (every rank's ``state_dict``), divided by ``copies``: the ranks
        of one model replica (tensor / pipeline parallel) read the same samples, so each is counted ``copies``
        times."""
        skipped: Counter[str] = Counter()
        for state in states:
            skipped.update(state.get("skipped", {}))
        self.skipped = Counter({reason: n // copies for reason, n in skipped.items()})
        self.used = sum(int(s.get("used", 0)) for s in states) // copies
        self.truncated = sum(int(s.get("truncated", 0)) for s in states) // copies
        self.dropped_leading_reply = sum(int(s.get("dropped_leading_reply", 0)) for s in states) // copies
        budget: Counter[str] = Counter()
        for state in states:
            budget.update(state.get("visual_budget", {}))
        self.visual_budget = Counter({action: n // copies for action, n in budget.items()})
