"""Task outcomes and the one rule that folds per-rank results into one.

A task runs on every rank; it is ``ok`` only if every rank said ok, the first
non-ok rank result wins (sticky), and ranks that never answer make it a
``timeout``.  The broker (for its books) and the client (for its caller) both
fold results with :class:`RankFold`, so the rule lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .vocab import Outcome


@dataclass
class TaskOutcome:
    """The final word on one task, as a client sees it."""

    task: int
    outcome: str
    reason: str = ""
    bytes: int = 0
    elapsed_s: float = 0.0
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    never_ran: bool = False  # the broker said so: ``outcome{ran: false}`` (docs/protocol.md §7.3)
    every_rank_reported: bool = False  # each rank's result came (an ``ok`` always has them all)

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK

    @property
    def ran(self) -> bool | None:
        """Whether a rank ran the task: True once a rank reported it, False when
        the broker ended it before dispatch (no block was touched: a swap-in's
        destination is as it was), None when nobody can say (the client gave
        up waiting, or a rank died with it)."""
        if self.per_rank:
            return True
        return False if self.never_ran else None

    @property
    def copies_over(self) -> bool:
        """Whether no rank can still write this task's destination: it never ran,
        it ended ``ok`` (every rank done) or every rank reported.  A timeout, or
        a failure with a rank unheard (one died while the others still copied),
        may still be written late (``zkv.rows.ending``)."""
        return self.never_ran or self.every_rank_reported or self.outcome == Outcome.OK

    def to_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "outcome": self.outcome,
            "reason": self.reason,
            "bytes": self.bytes,
            "elapsed_ms": round(self.elapsed_s * 1000, 3),
            "ran": self.ran,
            "ranks": {
                str(r): {k: v for k, v in res.items() if k != "digests"} for r, res in sorted(self.per_rank.items())
            },
        }


class RankFold:
    """Accumulates per-rank outcomes of one task until every rank answered."""

    __slots__ = ("waiting", "outcome", "reason", "bytes")

    def __init__(self, ranks: int | set[int]):
        self.waiting: set[int] = set(range(ranks)) if isinstance(ranks, int) else set(ranks)
        self.outcome: str = Outcome.OK
        self.reason = ""
        self.bytes = 0

    def add(self, rank: int, outcome: str, reason: str = "", nbytes: int = 0) -> bool:
        """Fold one rank's result; return False if that rank was not awaited."""
        if rank not in self.waiting:
            return False
        self.waiting.discard(rank)
        self.bytes += nbytes
        if outcome != Outcome.OK and self.outcome == Outcome.OK:
            self.outcome = outcome
            self.reason = f"rank {rank}: {reason}" if reason else f"rank {rank}: {outcome}"
        return True

    def fail(self, outcome: str, reason: str) -> None:
        """Force a non-ok outcome (first one wins), e.g. a rank that died."""
        if self.outcome == Outcome.OK:
            self.outcome = outcome
            self.reason = reason

    @property
    def complete(self) -> bool:
        return not self.waiting
