"""The broker's state machine, with no sockets (sans-IO).

Events go in (a frontend message from a client, a backend message from a
rank, a clock tick) and actions come out (frames to send, a control message to
publish, a record for the trace).  The ZMQ loop in ``loop.py`` only moves
frames; the replay harness and the unit tests drive this class directly.

``BrokerCore`` decodes each event and routes it to the part that owns what it
changes, each part owning its own fields: ``tasks.py`` (:class:`TaskTable`:
submit, dispatch, done), ``ranks.py`` (:class:`RankTable`: registration,
liveness), ``control.py`` (:class:`ControlMachine`: pause, clear, resume,
acks, publishing), ``generation.py`` (:class:`Generation`: layout and cache
generation), ``recovery.py`` (:class:`Recovery`: the durable snapshot and a
registering rank's reconciliation); the bus states and their transitions in
``state.py``.  The actions and records are re-exported here.

Invariants it keeps (docs/architecture.md, "The rules"):
- a task is dispatched to every rank at once, and only while running with all
  ``world`` ranks alive and each holding a free credit;
- every submitted task ends exactly once: ranks report ok/failed to the
  client; the broker itself reports rejected / cancelled / failed-rank-died;
- pause is complete only when every live rank acked the current epoch with the
  exact count of tasks dispatched to it; stale acks are counted and ignored;
- nothing waits forever: control ops have deadlines, ranks a liveness window.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Mapping, cast

from ..obs.book import BusBook
from ..wire import bounds
from ..wire import fast as F
from ..wire import protocol as P
from ..wire import sockets as S
from ..wire.layout import CacheLayout
from ..wire.messages import (
    Ack,
    Cancel,
    Clear,
    Done,
    Error,
    Heartbeat,
    Pause,
    Ping,
    Ready,
    Refused,
    Reregister,
    Resume,
    Status,
    Submit,
)
from ..wire.replies import PingReply, StatusReply
from .actions import Action, Publish, Record, SaveState, ToClient, ToRank, answer_to, error, frames_of
from .claims import Claim, ClaimTable
from .control import ControlMachine
from .generation import Generation
from .ranks import RankTable
from .records import BrokerConfig, PendingOp, RankState, Task
from .recovery import Recovery
from .state import CACHES_CLEARED, BusState
from .tasks import TaskTable
from .waiters import Waiter, WaiterBook

__all__ = [
    "Action",
    "BrokerConfig",
    "BrokerCore",
    "PendingOp",
    "Publish",
    "RankState",
    "Record",
    "SaveState",
    "Task",
    "ToClient",
    "ToRank",
    "frames_of",
]

log = logging.getLogger("zkv.broker")
# one decoder per socket, of the kinds it receives (wire/sockets.py)
_decode_request = F.decoder(S.BROKER_FRONTEND)
_decode_rank_msg = F.decoder(S.BROKER_BACKEND)  # a message of dones takes only S.BATCHED_DONE (§10.3)
# the frames that never change, made once
_REREGISTER = Reregister().to_wire()
_PROBE_ANSWER = Heartbeat(probe=True).to_wire()
_HEARTBEAT = Heartbeat().to_wire()


class BrokerCore:
    """Events in, actions out.  ``now`` is seconds on a monotonic clock.
    ``book`` (default: a new :class:`BusBook`) counts and books what happens."""

    def __init__(
        self,
        config: BrokerConfig | None = None,
        recording: bool = False,
        restore: dict[str, Any] | None = None,
        book: BusBook | None = None,
    ):
        self.cfg = config or BrokerConfig()
        self.recording = recording
        self._book = book if book is not None else BusBook()  # metrics (zkv.obs): read at scrape time, never here
        self._events = self._book.events
        self.rank_table = RankTable(self.cfg, self._events, recording)
        self.gens = Generation()
        self.tasks = TaskTable(self.cfg, self._book, recording, self.rank_table, self.gens)
        self.control = ControlMachine(self.cfg, self._book, recording, self.rank_table, self.gens, self.tasks)
        self.recovery = Recovery(
            self.cfg, self._events, recording, self.rank_table, self.gens, self.control, self.tasks
        )
        self.ready_waiters = WaiterBook(self.cfg.max_waiters_per_client, self.cfg.max_waiters)
        # a rank heartbeats every heartbeat_ms: two of them is the window a live one has to speak
        self.claims = ClaimTable(min(2 * self.cfg.heartbeat_ms, self.cfg.liveness_ms) / 1000)
        if restore is not None:
            self.recovery.restore(restore)

    # --- read-only views for the loop, the metrics export and tests ---------------------

    @property
    def book(self) -> BusBook:
        return self._book

    @property
    def counters(self) -> Mapping[str, int]:
        """What status reports as ``counters`` (a snapshot; the loop counts in ``book.events``)."""
        return MappingProxyType(self._book.counters())

    @property
    def state(self) -> BusState:
        return self.control.state

    @property
    def epoch(self) -> int:
        return self.control.epoch

    @property
    def pending(self) -> PendingOp | None:
        return self.control.pending

    @property
    def gen(self) -> int:
        return self.gens.gen

    @property
    def layout(self) -> CacheLayout | None:
        return self.gens.layout

    @property
    def ranks(self) -> dict[int, RankState]:
        return self.rank_table.ranks

    @property
    def queue(self) -> collections.deque[Task]:
        return self.tasks.compact()

    @property
    def inflight(self) -> dict[int, Task]:
        return self.tasks.inflight

    def _internal(self, err: Exception, where: str) -> str:
        """Count and log a bug in a handler; the reason for the ``internal`` error reply."""
        self._events["internal_errors"] += 1
        log.error("internal error handling %s", where, exc_info=err)
        return f"internal error handling {where}: {type(err).__name__}: {err}; the broker keeps serving"

    # --- frontend --------------------------------------------------------------

    def on_client(self, client: bytes, frames: list[bytes], now: float) -> list[Action]:
        """A message from a client DEALER (identity already stripped).  A bug in
        a handler still answers the client: ``error{code: internal}``, counted."""
        out: list[Action] = []
        try:
            self._on_client(client, frames, now, out)
        except Exception as err:  # noqa: BLE001 - every request gets an answer
            ids = P.salvage_ids(frames[0]) if frames else {}
            out.append(error(client, "internal", self._internal(err, "a client request"), **ids))
        self.recovery.save_if_changed(out)
        return out

    def _on_client(self, client: bytes, frames: list[bytes], now: float, out: list[Action]) -> None:
        self._events["client_msgs"] += 1
        try:
            P.check_frames(frames, 1, 2)
            msg = _decode_request(frames[0])
        except P.ProtocolError as err:
            self._book.bad_request(err.code)
            out.append(error(client, err.code, err.reason, **P.salvage_ids(frames[0] if frames else b"")))
            return
        match msg:
            case Submit():
                control = self.control
                if (
                    self.tasks.submit(client, msg, frames, control.state in CACHES_CLEARED, now, out)
                    and control.state is BusState.RUNNING
                ):
                    self.tasks.dispatch(now, out)
            case Status():
                self._status(client, msg, now, out)
            case Ping():
                out.append(answer_to(client, PingReply(msg.req)))
            case Cancel():
                self.tasks.cancel(client, msg, now, out)
            case Pause() | Clear() | Resume():
                self._control_request(client, msg, now, out)
            case _:  # the decoder lets through only the kinds above
                raise TypeError(f"no handler for a client's {msg.kind}")

    def _control_request(self, client: bytes, msg: Pause | Clear | Resume, now: float, out: list[Action]) -> None:
        if self.recording:
            named = msg.to_dict()  # a layout as its map
            params: dict[str, Any] = {k: named[k] for k in ("keep_cpu", "layout", "timeout_ms") if k in named}
            out.append(Record({"ev": "request", "op": msg.kind, "t": now, "client": client.hex(), **params}))
        match msg:
            case Pause():
                self.control.pause(client, msg, now, out)
            case Clear():
                self.control.clear(client, msg, now, out)
            case Resume():
                self.control.resume(client, msg, now, out)

    def _status(self, client: bytes, msg: Status, now: float, out: list[Action]) -> None:
        want = msg.wait_ranks or 0
        if self.rank_table.ready_count() >= want:
            out.append(answer_to(client, self.status_answer(msg.req, now)))
        elif want > self.cfg.world:  # could never be met: say so now instead of holding it
            out.append(
                error(
                    client,
                    "bad_field",
                    f"status.wait_ranks {want} exceeds the world size {self.cfg.world}",
                    req=msg.req,
                )
            )
        else:  # held: answered on registration, or with an error at the deadline
            waiter = Waiter(client, msg.req, want, now + self.cfg.timeout_s(msg.timeout_ms))
            self.ready_waiters.hold(waiter, self._events, out)

    def _answer_ready_waiters(self, now: float, out: list[Action]) -> None:
        """Reply to ``status --wait-ranks`` requests that are satisfied or expired."""
        ready = self.rank_table.ready_count()
        met, expired = self.ready_waiters.settle(now, ready)
        status = self.status_answer(0, now) if met else None
        for w in met:
            out.append(answer_to(w.client, replace(cast(StatusReply, status), req=w.req)))
        for w in expired:
            out.append(
                error(w.client, "timeout", f"only {ready} of {w.want} ranks registered before the deadline", req=w.req)
            )

    # --- backend ---------------------------------------------------------------

    def on_rank(self, identity: bytes, frames: list[bytes], now: float) -> list[Action]:
        """A message from a rank DEALER (identity already stripped); a bug in a
        handler answers the rank ``error{code: internal}``, counted."""
        out: list[Action] = []
        try:
            self._on_rank(identity, frames, now, out)
        except Exception as err:  # noqa: BLE001
            reason = P.clamp(self._internal(err, "a rank message"))
            out.append(ToRank(identity, [Error(code="internal", reason=reason).to_wire()]))
        self.recovery.save_if_changed(out)
        return out

    def _on_rank(self, identity: bytes, frames: list[bytes], now: float, out: list[Action]) -> None:
        if len(frames) > 1:  # the done frames of one rank wakeup (docs/protocol.md §10.3)
            try:
                P.check_frames(frames, 1, bounds.MAX_BATCH)
            except P.ProtocolError as err:
                self._events["bad_rank_msgs"] += 1
                out.append(ToRank(identity, [Error(code=err.code, reason=err.reason).to_wire()]))
                return
            for frame in frames:  # each on its own: one bad frame loses no other's credit
                self._on_rank_frame(identity, frame, S.BATCHED_DONE, now, out)
            return
        self._on_rank_frame(identity, frames[0], None, now, out)

    def _on_rank_frame(
        self, identity: bytes, frame: bytes, only: tuple[str, ...] | None, now: float, out: list[Action]
    ) -> None:
        try:
            msg = _decode_rank_msg(frame, only)
        except P.LayoutError as err:
            if err.kind == "ready":  # an invalid layout: refused, and the rank exits (docs/protocol.md §10.1)
                self.rank_table.counters["refused"] += 1
                out.append(ToRank(identity, [Refused(reason=P.clamp(f"bad layout: {err.reason}")).to_wire()]))
                return
            self._events["bad_rank_msgs"] += 1
            out.append(ToRank(identity, [Error(code=err.code, reason=err.reason).to_wire()]))
            return
        except P.ProtocolError as err:
            self._events["bad_rank_msgs"] += 1
            out.append(ToRank(identity, [Error(code=err.code, reason=err.reason).to_wire()]))
            return
        if isinstance(msg, Ready):
            self._ready(identity, msg, now, out)
            return
        rs = self.rank_table.sender(identity)
        if rs is None:
            self._events["unregistered_msgs"] += 1
            out.append(ToRank(identity, [_REREGISTER]))
            return
        rs.last_seen = now
        if self.claims.claims and rs.rank in self.claims.claims:  # it is alive: refuse the claimant
            self.claims.refuse(rs, now, self._events, self.recording, out)
        if not rs.welcomed:
            rs.welcomed = True
            self._dispatch(now, out)
        match msg:
            case Done():
                if self.tasks.done(rs, msg, now, out) and self.control.state is BusState.RUNNING:
                    self.tasks.dispatch(now, out)
            case Heartbeat():
                if msg.stats:
                    rs.stats = msg.stats
                if msg.probe:  # a rank back from a freeze asks if it is still ours
                    out.append(ToRank(identity, [_PROBE_ANSWER]))
            case Ack():
                self.control.ack(rs, msg, now, out)
            case _:  # the decoders let through only ready, done, hb and ack
                raise TypeError(f"no handler for a rank's {msg.kind}")

    def _dispatch(self, now: float, out: list[Action]) -> None:
        if self.control.state is BusState.RUNNING:
            self.tasks.dispatch(now, out)

    def _ready(self, identity: bytes, msg: Ready, now: float, out: list[Action]) -> None:
        """A rank registers (or re-registers): checked, reconciled with the
        bus (``recovery.py``) and welcomed with the bus's state."""
        table = self.rank_table
        layout, refusal = table.admit(msg, self.gens.layout)
        if layout is None:
            out.append(ToRank(identity, [Refused(reason=P.clamp(refusal)).to_wire()]))
            return
        rank = msg.rank
        if not table.is_repeat(identity, msg):
            old = table.ranks.get(rank)
            if old is not None and old.alive and old.identity != identity:
                # another process: the rank restarted, or a second one claims it (claims.py)
                if self.claims.park(identity, msg, layout, now):
                    out.append(ToRank(old.identity, [_HEARTBEAT]))  # undeliverable if its connection is gone
                return
            if old is not None and old.alive:
                self._rank_lost(old, f"rank {rank} re-registered (restarted); its tasks were lost", now, out)
            table.register(identity, msg, now)
        self.gens.adopt_layout(layout)
        rs = table.ranks[rank]
        rs.last_seen = now
        self.recovery.reconcile(rank, msg, layout, now, out)
        out.append(ToRank(identity, [self.control.welcome(rs)]))
        if self.recording:
            assert self.gens.layout is not None
            out.append(Record({"ev": "rank", "t": now, "rank": rank, "up": True, "layout": self.gens.layout.to_wire()}))
        if self.ready_waiters:
            self._answer_ready_waiters(now, out)
        self._dispatch(now, out)

    def _hand_over(self, claim: Claim, why: str, now: float, out: list[Action]) -> None:
        """The live rank is gone (``why``): the claimant is its restart and registers."""
        old = self.rank_table.ranks.get(claim.msg.rank)
        if old is not None and old.alive and old.identity != claim.identity:
            self._rank_lost(old, f"rank {old.rank} {why}; a new process took it over", now, out)
        self._ready(claim.identity, claim.msg, now, out)

    def on_unreachable(self, identity: bytes, now: float) -> list[Action]:
        """The loop could not deliver to ``identity`` (its connection is gone).
        Only a rank whose number another process claims is given up at once;
        any other waits out its liveness window (a reconnecting link looks the same)."""
        out: list[Action] = []
        rs = self.rank_table.sender(identity)
        claim = self.claims.take(rs.rank) if rs is not None else None
        if claim is not None:
            self._hand_over(claim, "lost its connection", now, out)
            self.recovery.save_if_changed(out)
        return out

    def _rank_lost(self, rs: RankState, reason: str, now: float, out: list[Action]) -> None:
        """A rank died or restarted: fail its tasks now, never leave them hanging."""
        self.rank_table.lose(rs, reason, now, out)
        self.tasks.fail_rank(rs, reason, now, out)
        self.control.rank_lost(reason, now, out)

    # --- clock -------------------------------------------------------------------

    def on_tick(self, now: float) -> list[Action]:
        """Heartbeats, liveness, control repeats and op deadlines."""
        out: list[Action] = []
        try:
            self._on_tick(now, out)
        except Exception as err:  # noqa: BLE001 - the clock must keep ticking
            self._internal(err, "a clock tick")
        self.recovery.save_if_changed(out)
        return out

    def _on_tick(self, now: float, out: list[Action]) -> None:
        self.control.retry(now, out)
        for claim in self.claims.expired(now):
            self._hand_over(claim, f"said nothing for {self.claims.window_s:.1f} s", now, out)
        for rs in self.rank_table.silent(now):
            self._rank_lost(
                rs, f"rank {rs.rank} stopped answering (no message for {self.cfg.liveness_ms} ms)", now, out
            )
        self.rank_table.beat(now, out)
        self.control.repeat(now, out)
        if self.ready_waiters and now >= self.ready_waiters.due:  # no scan until one is due
            self._answer_ready_waiters(now, out)
        self.control.expire(now, out)
        self.tasks.expire(now, out)

    def next_deadline(self, now: float) -> float:
        """Seconds until on_tick has something to do (for the poll timeout)."""
        due = self.rank_table.deadlines() + self.control.deadlines() + self.claims.deadlines()
        due += (self.ready_waiters.due, self.tasks.deadline())
        return max(0.0, min(due) - now)

    def status_answer(self, req: int, now: float) -> StatusReply:
        """The reply to ``status`` (docs/protocol.md §8.4), typed."""
        control, gens, tasks, ranks = self.control, self.gens, self.tasks, self.rank_table.ranks
        return StatusReply(
            req,
            state=control.state,
            epoch=control.epoch,
            gen=gens.gen,
            cpu_gen=gens.cpu_gen,
            gen_reason=gens.reason,
            weights=gens.weights,
            world=self.cfg.world,
            layout=gens.layout,
            ranks=tuple(ranks[r].to_status(now) for r in sorted(ranks)),
            queued=tasks.queued(),
            inflight=len(tasks.inflight),
            max_inflight_per_rank=self.cfg.max_inflight_per_rank,
            pending_op=control.pending.op if control.pending else None,
            **control.own_resume.status(now),  # the broker's own resume, when it keeps failing (restate.py)
            counters=dict(self._book.counters()),
        )

    def status(self, now: float) -> dict[str, Any]:
        """The status reply's fields as a map (the recovery file and tests read them)."""
        return self.status_answer(0, now).wire_fields()
