"""``SampleError``: why a record cannot become a training sample, as the dataset counts it."""

from __future__ import annotations

from neva.errors import InputError


class SampleError(InputError, ValueError):
    """A record that is skipped: ``reason`` is the skip-count key (``missing_image``, ``too_long``...), ``detail``
    the specifics for the log."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
