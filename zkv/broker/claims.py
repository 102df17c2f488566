"""A second process that says it is a rank the bus already has.

A ``ready`` for a live rank from another identity is either that rank
restarted (its predecessor died and the broker has not noticed yet) or a
second process started with the same ``--rank`` by mistake.  Taking over at
once made two such processes take turns for good, every turn a rank death
and a generation move, with nothing saying why.  So the claim is parked and
the live one is probed: a probe the transport cannot deliver (its connection
is gone, as after kill -9) or a probe window without a word from it hands
the rank to the newcomer; any message from the live one in that window
proves it alive, and the newcomer is refused with a reason naming both.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from ..wire.layout import CacheLayout
from ..wire.messages import Ready, Refused
from .actions import Action, Record, ToRank
from .records import RankState

log = logging.getLogger("zkv.broker")


@dataclass
class Claim:
    """A parked ``ready``: who sent it, what it said, when the probe window ends."""

    identity: bytes
    msg: Ready
    layout: CacheLayout
    since: float
    deadline: float


class ClaimTable:
    """Parked claims by rank number (at most one each: the latest claimant's)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.claims: dict[int, Claim] = {}

    def park(self, identity: bytes, msg: Ready, layout: CacheLayout, now: float) -> bool:
        """Park ``msg``; True when this is a new claim (the live one needs a probe)."""
        old = self.claims.get(msg.rank)
        if old is not None and old.identity == identity:  # the claimant repeated its ready
            old.msg, old.layout = msg, layout
            return False
        self.claims[msg.rank] = Claim(identity, msg, layout, now, now + self.window_s)
        return True

    def take(self, rank: int) -> Claim | None:
        return self.claims.pop(rank, None)

    def refuse(
        self, live: RankState, now: float, events: collections.Counter[str], recording: bool, out: list[Action]
    ) -> None:
        """``live`` spoke while another process claimed its number: refuse that one, say so."""
        claim = self.claims.pop(live.rank)
        reason = refusal(live, claim, now)
        events["duplicate_ranks_refused"] += 1
        log.warning("%s", reason)
        out.append(ToRank(claim.identity, [Refused(reason=reason).to_wire()]))
        if recording:
            out.append(Record({"ev": "rank_refused", "t": now, "rank": live.rank, "reason": reason}))

    def expired(self, now: float) -> list[Claim]:
        """Claims whose live rank said nothing in the window: theirs now."""
        due = [c for c in self.claims.values() if now >= c.deadline]
        for c in due:
            del self.claims[c.msg.rank]
        return due

    def deadlines(self) -> list[float]:
        return [c.deadline for c in self.claims.values()]


def refusal(live: RankState, claim: Claim, now: float) -> str:
    """Why the claimant is refused, naming the live process and the claimant."""
    return (
        f"rank {live.rank} is served by a live process ({_who(live.pid, live.host)}, "
        f"last heard {max(0.0, now - live.last_seen):.1f} s ago); refusing {_who(claim.msg.pid, claim.msg.host)}: "
        f"stop one of them or give this one another --rank"
    )


def _who(pid: int | None, host: str | None) -> str:
    return f"pid {pid or '?'} on {host or 'an unnamed host'}"
