"""The ranks of the bus (docs/protocol.md §10): who is registered under which
identity and session, who is alive, and the broker's side of the heartbeat.
A ``ready`` is checked here against the world size; the welcome, a rank's
reconciliation with the bus and the failing of a lost rank's tasks are the
core's, across the parts (``core.py``)."""

from __future__ import annotations

import collections

from ..wire.layout import CacheLayout
from ..wire.messages import Heartbeat, Ready
from .actions import Action, Record, ToRank
from .records import BrokerConfig, RankState


def layout_difference(mine: CacheLayout, bus: CacheLayout) -> str:
    """The fields where two layouts differ, both values named: ``gpu_blocks 32 (the bus: 64)``."""
    a, b = mine.to_wire(), bus.to_wire()
    return ", ".join(f"{k} {a[k]} (the bus: {b[k]})" for k in a if a[k] != b.get(k))


class RankTable:
    """Registered ranks by number and by identity, and their liveness."""

    def __init__(self, cfg: BrokerConfig, counters: collections.Counter[str], recording: bool):
        self.cfg = cfg
        self.counters = counters
        self.recording = recording
        self.ranks: dict[int, RankState] = {}
        self.by_identity: dict[bytes, int] = {}
        self.last_heartbeat = 0.0

    def live(self) -> list[RankState]:
        return [rs for rs in self.ranks.values() if rs.alive]

    def ready_count(self) -> int:
        return sum(1 for rs in self.ranks.values() if rs.alive)

    def sender(self, identity: bytes) -> RankState | None:
        """The live rank registered under ``identity``; None: tell it to re-register."""
        rank = self.by_identity.get(identity)
        rs = self.ranks.get(rank) if rank is not None else None
        if rs is None or not rs.alive or rs.identity != identity:
            return None
        return rs

    def admit(self, msg: Ready, bus: CacheLayout | None) -> tuple[CacheLayout | None, str]:
        """A ``ready``'s layout, or why the rank is refused: another world size, or a
        new process started with another layout than the bus's
        (``bus``) that did not ask to adopt it (docs/protocol.md §10.1): never
        resized behind its operator's back."""
        rank, world = msg.rank, msg.world
        if world != self.cfg.world or rank >= world:
            self.counters["refused"] += 1
            return None, f"rank {rank} of world {world} does not fit this broker's world size {self.cfg.world}"
        layout = msg.layout  # typed and checked by the decoder
        if msg.fresh and bus is not None and layout != bus and not msg.adopt_layout:
            self.counters["refused"] += 1
            return None, (
                f"rank {rank} was started with another layout than the bus's: {layout_difference(layout, bus)} "
                f"(blocks of {layout.block_bytes} bytes; the bus's: {bus.block_bytes}): start it with the bus's "
                "layout (zkv status shows it), let it take the bus's (--adopt-layout), or, for a rank on an "
                "engine's memory, bring the bus to its layout (zkv pause, zkv clear, zkv resume with it)"
            )
        return layout, ""

    def is_repeat(self, identity: bytes, msg: Ready) -> bool:
        """The same live process said ``ready`` again (its welcome crossed it)."""
        old = self.ranks.get(msg.rank)
        if old is not None and old.alive and old.identity == identity and old.session == msg.session:
            self.counters["duplicate_ready"] += 1
            return True
        return False

    def register(self, identity: bytes, msg: Ready, now: float) -> None:
        """A new process (or session) takes the rank over; its predecessor,
        if it was alive, was lost first (``lose``)."""
        rank = msg.rank
        old = self.ranks.get(rank)
        if old is not None and old.identity != identity:
            self.by_identity.pop(old.identity, None)
        self.ranks[rank] = RankState(
            rank, identity, msg.session, msg.pid or 0, now, welcomed=old is None, host=msg.host or ""
        )
        self.by_identity[identity] = rank
        self.counters["registrations"] += 1

    def lose(self, rs: RankState, reason: str, now: float, out: list[Action]) -> None:
        rs.alive = False
        self.counters["rank_deaths"] += 1
        if self.recording:
            out.append(Record({"ev": "rank", "t": now, "rank": rs.rank, "up": False, "reason": reason}))

    def silent(self, now: float) -> list[RankState]:
        """Live ranks past their liveness window."""
        limit = self.cfg.liveness_ms
        return [rs for rs in self.live() if (now - rs.last_seen) * 1000 > limit]

    def beat(self, now: float, out: list[Action]) -> None:
        """Heartbeat every live rank when one is due."""
        if (now - self.last_heartbeat) * 1000 >= self.cfg.heartbeat_ms:
            self.last_heartbeat = now
            beat = Heartbeat().to_wire()
            for rs in self.live():
                out.append(ToRank(rs.identity, [beat]))

    def upto(self) -> list[int]:
        """Tasks dispatched to each rank in its session (what a pause names)."""
        return [self.ranks[r].dispatched if r in self.ranks else 0 for r in range(self.cfg.world)]

    def deadlines(self) -> list[float]:
        due = [self.last_heartbeat + self.cfg.heartbeat_ms / 1000]
        window = self.cfg.liveness_ms / 1000
        due.extend(rs.last_seen + window for rs in self.live())
        return due
