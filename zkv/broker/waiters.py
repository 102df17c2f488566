"""Held ``status{wait_ranks}`` requests, bounded per client and in all (sans-IO).

A client may ask the broker to hold a status request until N ranks are up.
Without bounds a client that floods such requests and vanishes makes the
broker hold (and scan on every wakeup) any number of them.  Here
each connection holds at most ``per_client``, all together at most ``total``,
every one expires at its deadline, and nothing is scanned until one is due.
When the total is reached, a connection holding fewer than the one holding the
most still gets room: that one's oldest request is dropped, so connections
that flood and disappear cannot lock out a client that holds few.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .actions import Action, error


@dataclass(frozen=True)
class Waiter:
    client: bytes
    req: int
    want: int  # ranks alive
    deadline: float


class WaiterBook:
    def __init__(self, per_client: int, total: int):
        self.per_client = per_client
        self.total = total
        self.held: list[Waiter] = []
        self.count: collections.Counter[bytes] = collections.Counter()
        self.due = float("inf")  # the earliest deadline held

    def __len__(self) -> int:
        return len(self.held)

    def admit(self, waiter: Waiter) -> tuple[bool, Waiter | None]:
        """Hold ``waiter`` if the bounds allow; returns (held, evicted)."""
        mine = self.count[waiter.client]
        if mine >= self.per_client:
            return False, None
        evicted = None
        if len(self.held) >= self.total:
            hog, most = max(self.count.items(), key=lambda kv: kv[1])
            if most <= mine:
                return False, None
            evicted = next(w for w in self.held if w.client == hog)  # its oldest: held is in arrival order
            self.held.remove(evicted)
            self._release(evicted.client)
        self.held.append(waiter)
        self.count[waiter.client] += 1
        self.due = min(w.deadline for w in self.held) if evicted else min(self.due, waiter.deadline)
        return True, evicted

    def hold(self, waiter: Waiter, events: collections.Counter[str], out: list[Action]) -> None:
        """Admit ``waiter``; the one refused or evicted is answered ``over_limit``."""
        held, evicted = self.admit(waiter)
        if evicted is not None:
            events["waiters_evicted"] += 1
            out.append(
                error(
                    evicted.client,
                    "over_limit",
                    "held status request dropped: the broker holds too many; retry later",
                    req=evicted.req,
                )
            )
        if not held:
            events["over_limit"] += 1
            out.append(
                error(
                    waiter.client,
                    "over_limit",
                    f"too many held status requests (at most {self.per_client} per connection, "
                    f"{self.total} in all); retry later",
                    req=waiter.req,
                )
            )

    def settle(self, now: float, ready: int) -> tuple[list[Waiter], list[Waiter]]:
        """Take out the waiters met by ``ready`` live ranks and those past
        their deadline: (met, expired)."""
        met, expired, keep = [], [], []
        for w in self.held:
            if ready >= w.want:
                met.append(w)
            elif now >= w.deadline:
                expired.append(w)
            else:
                keep.append(w)
                continue
            self._release(w.client)
        self.held = keep
        self.due = min((w.deadline for w in keep), default=float("inf"))
        return met, expired

    def _release(self, client: bytes) -> None:
        self.count[client] -= 1
        if self.count[client] <= 0:
            del self.count[client]
