"""The broker's state machine, with no sockets (sans-IO).

Events go in (a frontend message from a client, a backend message from a
rank, a clock tick) and actions come out (frames to send, a control message to
publish, a record for the trace).  The ZMQ loop in ``loop.py`` only moves
frames; the replay harness and the unit tests drive this class directly.

This module holds the entry points (``on_client``, ``on_rank``, ``on_tick``,
``next_deadline``, ``status``); the handlers live in mixins along the seams:
``tasks.py`` (submit, dispatch, done), ``control.py`` (pause, clear, resume,
acks), ``ranks.py`` (registration, rank loss), ``recovery.py`` (restarts and
generations); the bus states and their transitions in ``state.py``.  The
actions and records are re-exported here.

Invariants it keeps (DESIGN §1-§7):
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
from typing import Any, Callable

from ..wire import fast as F
from ..wire import protocol as P
from ..wire.layout import CacheLayout
from ..obs.book import BusBook
from .actions import Action, Publish, Record, SaveState, ToClient, ToRank, frames_of
from .control import Control
from .ranks import Ranks
from .records import BrokerConfig, PendingOp, RankState, Task
from .recovery import Recovery
from .state import BusState, ControlOp
from .tasks import Tasks
from .waiters import Waiter, WaiterBook

__all__ = ["Action", "BrokerConfig", "BrokerCore", "PendingOp", "Publish", "RankState", "Record", "SaveState", "Task",
           "ToClient", "ToRank", "frames_of"]

log = logging.getLogger("zkv.broker")
# the hot kind of each socket on the typed fast path, the rest as protocol.decode reads them
_decode_request = F.decoder("submit", ("submit", "pause", "clear", "resume", "status", "ping"))
_decode_rank_msg = F.decoder("done", ("ready", "hb", "done", "ack"))
_decode_done = F.decoder("done", ("done",))  # a frame of a message of dones (docs/protocol.md §10.3)


class BrokerCore(Tasks, Control, Ranks, Recovery):
    """Events in, actions out.  ``now`` is seconds on a monotonic clock."""

    def __init__(self, config: BrokerConfig | None = None, recording: bool = False, restore: dict[str, Any] | None = None):
        self.cfg = config or BrokerConfig()
        self.recording = recording
        self.layout: CacheLayout | None = None
        self.state = BusState.RUNNING
        self.epoch = 0
        self.gen = 0
        self.control_op = ControlOp.RUN
        self.control_extra: dict[str, Any] = {}
        self.pending: PendingOp | None = None
        self.ranks: dict[int, RankState] = {}
        self.by_identity: dict[bytes, int] = {}
        self.queue: collections.deque[Task] = collections.deque()
        self.inflight: dict[int, Task] = {}
        self.open_tasks: set[tuple[bytes, int]] = set()
        self.open_per_client: collections.Counter[bytes] = collections.Counter()
        self.seq = 0
        self.last_heartbeat = 0.0
        self.last_publish = 0.0
        self.counters: collections.Counter[str] = collections.Counter()
        self.ready_waiters = WaiterBook(self.cfg.max_waiters_per_client, self.cfg.max_waiters)
        self.book = BusBook()  # metrics (zkv.obs): read at scrape time, never here
        self.gen_used = False  # a task was dispatched at this generation: its content matters
        self.gen_reason = ""  # why the generation last moved (status says it)
        self.keep_cpu = False  # the last clear kept the CPU tier
        self.cpu_lost: list[int] = []  # ranks whose resume could not keep the CPU tier
        self.retry_at: float | None = None  # when to retry a failed broker-started resume
        self._saved_key: tuple | None = None
        if restore is not None:
            self._restore(restore)

    @staticmethod
    def _save_action(snapshot: dict[str, Any]) -> "SaveState":
        return SaveState(snapshot)

    @staticmethod
    def _record_action(event: dict[str, Any]) -> "Record":
        return Record(event)

    def _internal(self, err: Exception, where: str, counter: str = "internal_errors") -> str:
        """Count and log a bug in a handler; the reason for the ``internal`` error reply."""
        self.counters[counter] += 1
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
            out.append(self._error(client, "internal", self._internal(err, "a client request"), **ids))
        self._save_if_changed(out)
        return out

    def _on_client(self, client: bytes, frames: list[bytes], now: float, out: list[Action]) -> None:
        self.counters["client_msgs"] += 1
        try:
            P.check_frames(frames, 1, 2)
            msg = _decode_request(frames[0])
        except P.ProtocolError as err:
            self.counters["bad_requests"] += 1
            self.book.bad_request(err.code)
            out.append(self._error(client, err.code, err.reason, **P.salvage_ids(frames[0] if frames else b"")))
            return
        kind = msg["kind"]
        if kind == "submit":
            self._submit(client, msg, frames, now, out)
        elif kind == "status":
            self._status(client, msg, now, out)
        elif kind == "ping":
            out.append(self._reply(client, msg["req"], "ping"))
        else:
            if self.recording:
                params = {k: msg[k] for k in ("keep_cpu", "layout", "timeout_ms") if msg.get(k) is not None}
                out.append(Record({"ev": "request", "op": kind, "t": now, "client": client.hex(), **params}))
            getattr(self, "_" + kind)(client, msg, now, out)

    def _status(self, client: bytes, msg: dict, now: float, out: list[Action]) -> None:
        want = msg.get("wait_ranks") or 0
        if self._ready_ranks() >= want:
            out.append(self._reply(client, msg["req"], "status", **self.status(now)))
        elif want > self.cfg.world:  # could never be met: say so now instead of holding it
            out.append(self._error(client, "bad_field", f"status.wait_ranks {want} exceeds the world size {self.cfg.world}", req=msg["req"]))
        else:  # held: answered on registration, or with an error at the deadline
            held, evicted = self.ready_waiters.admit(Waiter(client, msg["req"], want, now + self._timeout_s(msg)))
            if evicted is not None:
                self.counters["waiters_evicted"] += 1
                out.append(self._error(evicted.client, "over_limit", "held status request dropped: the broker holds too many; retry later",
                                       req=evicted.req))
            if not held:
                self.counters["over_limit"] += 1
                out.append(self._error(client, "over_limit", f"too many held status requests (at most {self.cfg.max_waiters_per_client} "
                                       f"per connection, {self.cfg.max_waiters} in all); retry later", req=msg["req"]))

    # --- backend ---------------------------------------------------------------

    def on_rank(self, identity: bytes, frames: list[bytes], now: float) -> list[Action]:
        """A message from a rank DEALER (identity already stripped); a bug in a
        handler answers the rank ``error{code: internal}``, counted."""
        out: list[Action] = []
        try:
            self._on_rank(identity, frames, now, out)
        except Exception as err:  # noqa: BLE001
            out.append(ToRank(identity, [P.encode("error", code="internal", reason=self._internal(err, "a rank message"))]))
        self._save_if_changed(out)
        return out

    def _on_rank(self, identity: bytes, frames: list[bytes], now: float, out: list[Action]) -> None:
        if len(frames) > 1:  # the done frames of one rank wakeup (docs/protocol.md §10.3)
            try:
                P.check_frames(frames, 1, P.MAX_BATCH)
            except P.ProtocolError as err:
                self.counters["bad_rank_msgs"] += 1
                out.append(ToRank(identity, [P.encode("error", code=err.code, reason=err.reason)]))
                return
            for frame in frames:  # each on its own: one bad frame loses no other's credit
                self._on_rank_frame(identity, frame, _decode_done, now, out)
            return
        self._on_rank_frame(identity, frames[0], _decode_rank_msg, now, out)

    def _on_rank_frame(self, identity: bytes, frame: bytes, decode: Callable[[bytes], dict], now: float, out: list[Action]) -> None:
        try:
            msg = decode(frame)
        except P.ProtocolError as err:
            self.counters["bad_rank_msgs"] += 1
            out.append(ToRank(identity, [P.encode("error", code=err.code, reason=err.reason)]))
            return
        kind = msg["kind"]
        if kind == "ready":
            self._ready(identity, msg, now, out)
            return
        rank = self.by_identity.get(identity)
        rs = self.ranks.get(rank) if rank is not None else None
        if rs is None or not rs.alive or rs.identity != identity:
            self.counters["unregistered_msgs"] += 1
            out.append(ToRank(identity, [P.encode("reregister")]))
            return
        rs.last_seen = now
        if not rs.welcomed:
            rs.welcomed = True
            self._dispatch(now, out)
        if kind == "hb":
            if msg.get("stats"):
                rs.stats = msg["stats"]
            if msg.get("probe"):  # a rank back from a freeze asks if it is still ours
                out.append(ToRank(identity, [P.encode("hb", probe=True)]))
        elif kind == "done":
            self._done(rs, msg, now, out)
        else:
            self._ack(rs, msg, now, out)

    # --- clock -------------------------------------------------------------------

    def on_tick(self, now: float) -> list[Action]:
        """Heartbeats, liveness, control repeats and op deadlines."""
        out: list[Action] = []
        try:
            self._on_tick(now, out)
        except Exception as err:  # noqa: BLE001 - the clock must keep ticking
            self._internal(err, "a clock tick")
        self._save_if_changed(out)
        return out

    def _on_tick(self, now: float, out: list[Action]) -> None:
        if self.retry_at is not None and now >= self.retry_at and self.pending is None:
            self.retry_at = None
            self.counters["resume_retries"] += 1
            self._restate(now, out)
        for rs in self._live_ranks():
            if (now - rs.last_seen) * 1000 > self.cfg.liveness_ms:
                self._rank_lost(rs, f"rank {rs.rank} stopped answering (no message for {self.cfg.liveness_ms} ms)", now, out)
        if (now - self.last_heartbeat) * 1000 >= self.cfg.heartbeat_ms:
            self.last_heartbeat = now
            beat = P.encode("hb")
            for rs in self._live_ranks():
                out.append(ToRank(rs.identity, [beat]))
        if self.epoch and (now - self.last_publish) * 1000 >= self.cfg.control_repeat_ms:
            if any(rs.acked_epoch != self.epoch for rs in self._live_ranks()):
                self.counters["control_repeats"] += 1
                self._publish(now, out)
        if self.ready_waiters and now >= self.ready_waiters.due:  # no scan until one is due
            self._answer_ready_waiters(now, out)
        if self.pending is not None and self.pending.joined:
            self._expire_joined(now, out)
        if self.pending is not None and now >= self.pending.deadline:
            lagging = sorted(rs.rank for rs in self._live_ranks() if rs.acked_epoch != self.pending.epoch)
            ms = round((self.pending.deadline - self.pending.started) * 1000)
            self._fail_pending(f"{self.pending.op}_timeout", f"ranks {lagging} did not acknowledge {self.pending.op} epoch {self.pending.epoch} within {ms} ms", now, out)

    def next_deadline(self, now: float) -> float:
        """Seconds until on_tick has something to do (for the poll timeout)."""
        due = [self.last_heartbeat + self.cfg.heartbeat_ms / 1000]
        if self.epoch:
            due.append(self.last_publish + self.cfg.control_repeat_ms / 1000)
        if self.pending is not None:
            due.append(self.pending.deadline)
            due.extend(self.pending.joined.values())
        if self.retry_at is not None:
            due.append(self.retry_at)
        due.append(self.ready_waiters.due)
        for rs in self._live_ranks():
            due.append(rs.last_seen + self.cfg.liveness_ms / 1000)
        return max(0.0, min(due) - now)

    # --- helpers -------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "epoch": self.epoch,
            "gen": self.gen,
            "gen_reason": self.gen_reason,
            "world": self.cfg.world,
            "layout": self.layout.to_wire() if self.layout else None,
            "ranks": [self.ranks[r].to_json(now) for r in sorted(self.ranks)],
            "queued": len(self.queue),
            "inflight": len(self.inflight),
            "max_inflight_per_rank": self.cfg.max_inflight_per_rank,
            "pending_op": self.pending.op.value if self.pending else None,
            "counters": dict(self.counters),
        }

    def _reply(self, client: bytes, req: int, op: str, **fields: Any) -> ToClient:
        return ToClient(client, [P.encode("reply", req=req, op=op, **fields)])

    def _error(self, client: bytes, code: str, reason: str, **fields: Any) -> ToClient:
        return ToClient(client, [P.encode("error", code=code, reason=reason, **fields)])

    def _outcome(self, client: bytes, task: int, outcome: str, reason: str) -> ToClient:
        return ToClient(client, [P.encode("outcome", task=task, outcome=outcome, reason=reason, gen=self.gen)])


