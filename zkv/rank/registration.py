"""A rank's standing with its broker: its phase, its session and the clock of the link (sans-IO on ``now``).

``RankCore`` holds one and asks it whether a READY or heartbeat is due, whether
the broker went silent and whether the loop was frozen; what to send is the
core's business.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable


class RankPhase(Enum):
    """Where a rank stands with its broker.

    JOINING: a READY is out (first start, ``reregister``, a silent broker), no
    welcome for it yet: controls are ignored (the welcome carries the state)
    and no heartbeat goes out.  REGISTERED: welcomed in the current session.
    PROBING: registered, but back from a freeze: it asked the broker whether it
    is still its rank, and holds every task until the answer.  A rank frozen
    while JOINING probes at the welcome: a welcome that waited out the freeze
    may answer a registration the broker has since given up on."""

    JOINING = "joining"
    REGISTERED = "registered"
    PROBING = "probing"


class Registration:
    """The phase, the session (``sessions()`` makes each: unguessable in a real rank,
    ``worker.new_session``) and when the link last carried something each way."""

    def __init__(self, sessions: Callable[[], int], heartbeat_ms: int, liveness_ms: int):
        self.sessions = sessions
        self.session = 0
        self.pid = 0  # sent in every READY, re-registrations too
        self.host = ""  # likewise: with the pid, names this process to an operator
        self.phase = RankPhase.JOINING
        self.heartbeat_ms = heartbeat_ms  # the welcome names it
        self.liveness_ms = liveness_ms
        self.last_broker_msg = 0.0
        self.last_heartbeat_sent = 0.0
        self.last_ready_sent = 0.0
        self.last_wake = 0.0
        self.frozen_joining = False  # frozen while JOINING: the welcome, when it comes, starts a probe

    def begin(self, now: float) -> None:
        """A fresh session, not yet welcomed: the broker restarts its counts."""
        self.session = self.sessions()
        self.phase = RankPhase.JOINING
        self.last_wake = now
        self.last_broker_msg = now
        self.frozen_joining = False

    def welcomed(self) -> None:
        """The welcome of this session came: registered, or probing if the loop was
        frozen while it waited (see ``RankPhase``)."""
        if self.phase is RankPhase.JOINING:
            self.phase = RankPhase.PROBING if self.frozen_joining else RankPhase.REGISTERED
            self.frozen_joining = False

    def probe_answered(self) -> None:
        if self.phase is RankPhase.PROBING:
            self.phase = RankPhase.REGISTERED

    @property
    def registered(self) -> bool:
        """Welcomed in the current session (probing or not)."""
        return self.phase is not RankPhase.JOINING

    @property
    def probing(self) -> bool:
        return self.phase is RankPhase.PROBING

    def woke(self, now: float) -> bool:
        """The loop woke; whether it was frozen while registered (it did not run
        for half the liveness window), which starts a probe."""
        gap = now - self.last_wake
        self.last_wake = now
        if gap * 1000 <= self.liveness_ms / 2:
            return False
        if self.phase is RankPhase.JOINING:
            self.frozen_joining = True
        if self.phase is RankPhase.REGISTERED:
            self.phase = RankPhase.PROBING
            return True
        return False

    def ready_due(self, now: float) -> bool:
        """An unanswered READY is repeated every half liveness window."""
        return (now - self.last_ready_sent) * 1000 >= self.liveness_ms / 2

    def broker_silent(self, now: float) -> bool:
        return (now - self.last_broker_msg) * 1000 > self.liveness_ms

    def heartbeat_due(self, now: float) -> bool:
        return (now - self.last_heartbeat_sent) * 1000 >= self.heartbeat_ms

    def next_deadline(self, now: float) -> float:
        """Seconds until one of the checks above may change its answer."""
        if not self.registered:
            return max(0.0, self.last_ready_sent + self.liveness_ms / 2000 - now)
        due = min(self.last_heartbeat_sent + self.heartbeat_ms / 1000, self.last_broker_msg + self.liveness_ms / 1000)
        return max(0.0, due - now)


class RankRefused(Exception):
    """The broker will not take this rank (wrong world size or layout)."""


__all__ = ["RankPhase", "RankRefused", "Registration"]
