"""Replay a trace against a bus and check what happened.

Two halves.  The checker (``checker``: :func:`check`) is a pure function from a parsed
:class:`~zkv.trace.Trace` and an :class:`Observation` to a :class:`Report`:
no sockets, no clock, testable with hand-made observations.  The driver
(``driver``: :class:`Replayer`) is the thin part: it plays the trace's operations through
:class:`~zkv.client.Client` objects (one per trace client) at the recorded
timing or as fast as it can, files every outcome, and collects the ranks'
stats before and after.  Every wait in it is bounded.

Ordering.  The broker's ROUTER fair-queues between clients, so a pause sent
by one client could overtake submits another client sent just before it.
Before each pause / clear / resume the driver therefore pings every client
that submitted since the last control request (a ping is answered after every
earlier message of that client), and a control request returns before the
next record is played.  That makes a trace's expectations deterministic:
tasks submitted before a pause run, tasks submitted while paused are held,
then run after resume or are cancelled by a clear, and tasks submitted while
cleared are rejected.
"""

from .checker import COUNTERS, ControlResult, Observation, Observed, Report, check, format_report, rank_stats_fresh
from .driver import ObservingBook, Replayer, parse_speed, replay

__all__ = [
    "COUNTERS",
    "ControlResult",
    "Observation",
    "ObservingBook",
    "Observed",
    "Replayer",
    "Report",
    "check",
    "format_report",
    "parse_speed",
    "rank_stats_fresh",
    "replay",
]
