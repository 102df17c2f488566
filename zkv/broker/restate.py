"""The resume the broker starts itself to bring a registering rank in line
(docs/protocol.md §10.1), when it cannot succeed: how long until the next try
(exponential, capped: a resume that fails every time costs one try and one
log line per ``MAX_BACKOFF_S``, not a loop), what status shows of it, and the
way out an operator reads.  Sans-IO: the clock is the caller's ``now``."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("zkv.broker")

MAX_BACKOFF_S = 30.0
WAY_OUT = (
    "zkv pause stops the retries (the bus stays paused); then zkv clear and zkv resume with a layout the ranks "
    "can allocate, or fix the rank and zkv resume"
)


class Restate:
    """The failures in a row of the broker's own resume, and when it retries."""

    __slots__ = ("first_s", "failures", "error", "retry_at")

    def __init__(self, first_s: float):
        self.first_s = first_s  # the first retry's delay; each failure in a row doubles it, up to MAX_BACKOFF_S
        self.failures = 0
        self.error = ""  # the last failure's code and reason
        self.retry_at: float | None = None

    def failed(self, code: str, reason: str, now: float) -> float:
        """A broker-started resume failed: schedule the next try; its delay."""
        self.failures += 1
        delay = min(MAX_BACKOFF_S, self.first_s * 2 ** min(self.failures - 1, 32))
        self.retry_at = now + delay
        self.error = f"{code}: {reason}; {WAY_OUT}"
        log.warning(
            "the broker's own resume failed (%d in a row; next try in %.1f s): %s: %s; way out: %s",
            self.failures,
            delay,
            code,
            reason,
            WAY_OUT,
        )
        return delay

    def due(self, now: float) -> bool:
        """The retry is due now (once: the caller retries)."""
        if self.retry_at is None or now < self.retry_at:
            return False
        self.retry_at = None
        return True

    def stop(self) -> None:
        """A client acted (a pause, a resume of its own): no retry is pending."""
        self.retry_at = None

    def succeeded(self) -> None:
        self.failures, self.error, self.retry_at = 0, "", None

    def status(self, now: float) -> dict[str, Any]:
        """What status shows (docs/protocol.md §8.4): the failures in a row
        (0: none since its last success), the last one's error, and when it
        retries (None: no retry pending)."""
        retry_in = None if self.retry_at is None else round(max(0.0, self.retry_at - now), 3)
        return {"restate_failures": self.failures, "restate_error": self.error or None, "restate_retry_in_s": retry_in}
