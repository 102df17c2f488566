"""Ranks joining and leaving the bus (DESIGN §6, §11): a ``ready`` checked
against the world size and the layout, registration by session, the welcome
that tells a rank the bus's state, and a rank lost (dead or restarted) whose
tasks fail at once.  A mixin of :class:`~zkv.broker.core.BrokerCore`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..wire import protocol as P
from ..wire.layout import CacheLayout
from .actions import Action, Record, ToRank
from .records import PendingOp, RankState, Task


class Ranks:
    """Registration, the live set and rank loss (mixed into BrokerCore)."""

    if TYPE_CHECKING:  # what the mixin uses of BrokerCore
        cfg: Any
        counters: Any
        recording: bool
        epoch: int
        gen: int
        layout: CacheLayout | None
        control_op: Any
        control_extra: dict[str, Any]
        pending: PendingOp | None
        ranks: dict[int, RankState]
        by_identity: dict[bytes, int]
        inflight: dict[int, Task]
        ready_waiters: Any
        status: Any
        _reply: Any
        _error: Any
        _outcome: Any
        _dispatch: Any
        _finish_task: Any
        _reconcile: Any
        _check_pending: Any
        _fail_pending: Any

    def _ready_ranks(self) -> int:
        return sum(1 for rs in self.ranks.values() if rs.alive)

    def _answer_ready_waiters(self, now: float, out: list[Action]) -> None:
        """Reply to ``status --wait-ranks`` requests that are satisfied or expired."""
        ready = self._ready_ranks()
        met, expired = self.ready_waiters.settle(now, ready)
        status = self.status(now) if met else {}
        for w in met:
            out.append(self._reply(w.client, w.req, "status", **status))
        for w in expired:
            out.append(self._error(w.client, "timeout", f"only {ready} of {w.want} ranks registered before the deadline", req=w.req))

    def _live_ranks(self) -> list[RankState]:
        return [rs for rs in self.ranks.values() if rs.alive]

    def _ready(self, identity: bytes, msg: dict, now: float, out: list[Action]) -> None:
        rank, world = msg["rank"], msg["world"]
        if world != self.cfg.world or rank >= world:
            self.counters["refused"] += 1
            out.append(ToRank(identity, [P.encode("refused", reason=f"rank {rank} of world {world} does not fit this broker's world size {self.cfg.world}")]))
            return
        try:
            layout = CacheLayout.from_wire(msg["layout"])
        except (P.ProtocolError, TypeError) as err:
            out.append(ToRank(identity, [P.encode("refused", reason=f"bad layout: {err}")]))
            return
        old = self.ranks.get(rank)
        if old is not None and old.alive and old.identity == identity and old.session == msg["session"]:
            self.counters["duplicate_ready"] += 1
        else:
            if old is not None and old.alive:
                self._rank_lost(old, f"rank {rank} re-registered (restarted); its tasks were lost", now, out)
            if old is not None and old.identity != identity:
                self.by_identity.pop(old.identity, None)
            self.ranks[rank] = RankState(rank, identity, msg["session"], msg.get("pid") or 0, now, welcomed=old is None)
            self.by_identity[identity] = rank
            self.counters["registrations"] += 1
        if self.layout is None:
            self.layout = layout
        rs = self.ranks[rank]
        rs.last_seen = now
        self._reconcile(rank, msg, layout, now, out)
        # A rank joining during a resume with a new layout gets the new layout.
        extra = dict(self.control_extra)
        welcome_layout = extra.pop("layout", None) or self.layout.to_wire()
        out.append(ToRank(identity, [P.encode(
            "welcome", epoch=self.epoch, op=self.control_op, gen=self.gen, upto=rs.dispatched,
            layout=welcome_layout, heartbeat_ms=self.cfg.heartbeat_ms, session=rs.session, **extra)]))
        if self.recording:
            out.append(Record({"ev": "rank", "t": now, "rank": rank, "up": True, "layout": self.layout.to_wire()}))
        if self.ready_waiters:
            self._answer_ready_waiters(now, out)
        self._dispatch(now, out)

    def _rank_lost(self, rs: RankState, reason: str, now: float, out: list[Action]) -> None:
        """A rank died or restarted: fail its tasks now, never leave them hanging."""
        rs.alive = False
        self.counters["rank_deaths"] += 1
        if self.recording:
            out.append(Record({"ev": "rank", "t": now, "rank": rs.rank, "up": False, "reason": reason}))
        for seq, task in list(self.inflight.items()):
            if task.fold is None or rs.rank not in task.fold.waiting:
                continue
            task.fold.waiting.discard(rs.rank)
            task.fold.fail("failed", reason)
            if not task.reported:
                task.reported = True
                out.append(self._outcome(task.client, task.task, "failed", reason))
            if task.fold.complete:
                del self.inflight[seq]
                self._finish_task(task, "failed", reason, now, out, notify=False)
        rs.inflight = 0
        if self.pending is not None:
            if self.cfg.allow_partial:
                self._check_pending(now, out)
            else:
                self._fail_pending("rank_dead", f"{self.pending.op} epoch {self.pending.epoch} failed: {reason}", now, out)

