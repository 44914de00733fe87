"""Third-party lines that say nothing about the run, filtered by their exact message so that a run's first screen
is neva's own lines; every other warning and log line of every library still shows.

One table each: Python warnings (``warnings.filterwarnings``) and log records (a filter on the library's logger).
"""

from __future__ import annotations

import logging
import re
import warnings

# (message regex, why it is not about the run)
WARNINGS = (
    # With manual optimization Lightning cannot tell that neva checkpoints at step boundaries (after the optimizer
    # step, which is what resume needs) and warns on every run.
    (r".*no pre-optimization state was saved.*", "neva checkpoints after the optimizer step"),
    # Lightning's own pytree helper calls an API torch deprecated; nothing a user can change.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "Lightning's use of a torch API"),
    # Lightning counts an epoch's micro-batches against log_every_n_steps; neva writes metrics.csv every optimizer step
    # and Lightning's loggers go on logging across epochs, so "set a lower value" is advice about nothing.
    (r"The number of training batches \(\d+\) is smaller than the logging interval", "an epoch's batches, not steps"),
    # A run without validation data hands Lightning an empty list of validation loaders: intended, not a mistake.
    (r"Total length of `list` across ranks is zero", "no validation set (model.data.val_fraction 0)"),
)
# (logger, message regex, why)
LOG_LINES = (("pytorch_lightning.utilities.rank_zero", r".*\blitlogger\b", "an advertisement for a logging service"),)


class _DropMessages(logging.Filter):
    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def install() -> None:
    """Filter the table's warnings and log lines (idempotent)."""
    for message, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in {logger for logger, _, _ in LOG_LINES}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages([m for n, m, _ in LOG_LINES if n == name]))
