"""The broker's state machine, with no sockets (sans-IO).

Events go in (a frontend message from a client, a backend message from a
rank, a clock tick) and actions come out (frames to send, a control message to
publish, a record for the trace).  The ZMQ loop in ``broker.py`` only moves
frames; the replay harness and the unit tests drive this class directly.

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
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

from ..wire import protocol as P
from ..wire.layout import CacheLayout
from ..wire.outcome import RankFold
from .waiters import Waiter, WaiterBook
from .recovery import STABLE as _STABLE, Recovery

log = logging.getLogger("zkv.broker")


# --- actions -----------------------------------------------------------------


@dataclass(frozen=True)
class ToClient:
    client: bytes
    frames: list[bytes]


@dataclass(frozen=True)
class ToRank:
    identity: bytes
    frames: list[bytes]


@dataclass(frozen=True)
class Publish:
    frame: bytes


@dataclass(frozen=True)
class Record:
    event: dict[str, Any]


@dataclass(frozen=True)
class SaveState:
    """Write this snapshot to the broker's durable state file (``state_file.py``)."""

    snapshot: dict[str, Any]


Action = Union[ToClient, ToRank, Publish, Record, SaveState]




# --- configuration and state ---------------------------------------------------


@dataclass
class BrokerConfig:
    world: int = 2
    max_inflight_per_rank: int = 64
    max_queue: int = 100_000
    heartbeat_ms: int = 500
    liveness_ms: int = 2_000
    control_repeat_ms: int = 100
    op_timeout_ms: int = 30_000
    allow_partial: bool = False  # a dead rank completes (not fails) a pending op
    # Per-client bounds (DESIGN §13): a flooding or vanished client holds at most
    # this much broker state, and every piece of it expires.
    max_open_per_client: int = 10_000  # queued + in-flight tasks of one connection
    max_waiters_per_client: int = 16  # held status{wait_ranks} requests of one connection
    max_waiters: int = 1024  # held status requests of all connections


@dataclass
class RankState:
    rank: int
    identity: bytes
    session: int
    pid: int
    last_seen: float
    alive: bool = True
    inflight: int = 0
    dispatched: int = 0  # per-session count; a pause names it as ``upto``
    # The rank has its welcome: it sent something other than a ready since.
    # A rank *back* (from an outage, a restart) gets tasks only then, so none
    # is sent down a connection whose way back is still in TCP backoff, or
    # dies before the welcome gets through: its ready can arrive first.
    welcomed: bool = True
    acked_epoch: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "alive": self.alive,
            "pid": self.pid,
            "inflight": self.inflight,
            "dispatched": self.dispatched,
            "acked_epoch": self.acked_epoch,
            "last_seen_ms": round((now - self.last_seen) * 1000, 1),
            "stats": self.stats,
        }


@dataclass
class Task:
    client: bytes
    task: int
    reply_to: str
    body: bytes
    submitted: float
    reply_key: str | None = None  # the client's Curve public key, for its PULL
    expires: float | None = None  # submit timeout_ms: a task still queued then never runs
    seq: int = 0
    fold: RankFold | None = None
    reported: bool = False  # the broker already sent the client a final outcome


@dataclass
class PendingOp:
    op: str
    epoch: int
    started: float
    deadline: float
    waiters: list[tuple[bytes, int]]
    previous_state: str
    extra: dict[str, Any] = field(default_factory=dict)
    joined: dict[tuple[bytes, int], float] = field(default_factory=dict)  # a joiner's own, earlier deadline


class BrokerCore(Recovery):
    """Events in, actions out.  ``now`` is seconds on a monotonic clock."""

    def __init__(self, config: BrokerConfig | None = None, recording: bool = False, restore: dict[str, Any] | None = None):
        self.cfg = config or BrokerConfig()
        self.recording = recording
        self.layout: CacheLayout | None = None
        self.state = "running"  # running pausing paused clearing cleared resuming
        self.epoch = 0
        self.gen = 0
        self.control_op = "run"
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
            msg = P.decode(frames[0], ("submit", "pause", "clear", "resume", "status", "ping"))
        except P.ProtocolError as err:
            self.counters["bad_requests"] += 1
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

    def _submit(self, client: bytes, msg: dict, frames: list[bytes], now: float, out: list[Action]) -> None:
        task_id = msg["task"]
        body = frames[1] if len(frames) == 2 else b""
        key = (client, task_id)
        if key in self.open_tasks:  # not a task of its own: an error, no outcome
            self.counters["duplicate_tasks"] += 1
            out.append(self._error(client, "duplicate_task", f"task {task_id} is still open", task=task_id))
            return
        if self.recording:  # every task, also the ones turned away below
            out.append(Record({"ev": "submit", "t": now, "client": client.hex(), "task": task_id, "body": body}))
        reply_to = msg["reply_to"]
        reason = ""
        if len(frames) != 2:
            self.counters["bad_requests"] += 1
            reason = "submit needs a header frame and a body frame"
        elif len(body) > P.MAX_FRAME_BYTES:
            self.counters["bad_requests"] += 1
            reason = f"task body of {len(body)} bytes exceeds {P.MAX_FRAME_BYTES}"
        elif not P.is_result_address(reply_to):
            self.counters["bad_requests"] += 1
            reason = f"reply_to {reply_to[:80]!r} is not an ipc://PATH or tcp://IP:PORT address (numeric IP, at most {P.MAX_ADDRESS} characters)"
        elif self.state in ("clearing", "cleared"):
            reason = "caches are cleared; resume the bus first (zkv resume)"
        elif len(self.queue) >= self.cfg.max_queue:
            reason = f"queue full ({self.cfg.max_queue} tasks); retry later"
        elif self.open_per_client[client] >= self.cfg.max_open_per_client:
            self.counters["over_limit"] += 1
            reason = f"this connection has {self.cfg.max_open_per_client} open tasks (the most it may); wait for some to end"
        expires = now + msg["timeout_ms"] / 1000 if msg.get("timeout_ms") else None
        task = Task(client, task_id, reply_to, body, now, msg.get("reply_key"), expires)
        if reason:
            self._finish_task(task, "rejected", reason, now, out, notify=True)
            return
        self.open_tasks.add(key)
        self.open_per_client[client] += 1
        self.queue.append(task)
        self.counters["submitted"] += 1
        self._dispatch(now, out)

    # --- control operations ------------------------------------------------------

    def _timeout_s(self, msg: dict) -> float:
        return (msg.get("timeout_ms") or self.cfg.op_timeout_ms) / 1000.0

    def _join_or_busy(self, client: bytes, msg: dict, op: str, now: float, out: list[Action]) -> bool:
        """A request during a pending op: join it if same op, else say busy."""
        if self.pending is None:
            return False
        if self.pending.op == op:
            self.pending.waiters.append((client, msg["req"]))
            mine = now + self._timeout_s(msg)
            if mine < self.pending.deadline:  # answered by its own deadline, even if the op goes on
                self.pending.joined[(client, msg["req"])] = mine
        else:
            out.append(self._error(client, "busy", f"{self.pending.op} epoch {self.pending.epoch} is in progress; retry when it completes", req=msg["req"]))
        return True

    def _pause(self, client: bytes, msg: dict, now: float, out: list[Action]) -> None:
        if self._join_or_busy(client, msg, "pause", now, out):
            return
        if self.state in ("paused", "cleared"):
            out.append(self._reply(client, msg["req"], "pause", noop=True, state=self.state, epoch=self.epoch, gen=self.gen, drain_ms=0.0, note=f"already {self.state}"))
            return
        self._begin(client, msg, "pause", "pausing", now, out)

    def _clear(self, client: bytes, msg: dict, now: float, out: list[Action]) -> None:
        if self._join_or_busy(client, msg, "clear", now, out):
            return
        if self.state == "cleared":
            out.append(self._reply(client, msg["req"], "clear", noop=True, state=self.state, epoch=self.epoch, gen=self.gen, cancelled=0, freed=0, note="already cleared"))
            return
        if self.state != "paused":
            out.append(self._error(client, "not_paused", "clear needs a paused bus: run zkv pause first", req=msg["req"]))
            return
        cancelled = 0
        while self.queue:
            task = self.queue.popleft()
            cancelled += 1
            self._finish_task(task, "cancelled", "caches were cleared while the task was queued", now, out, notify=True)
        self.gen += 1
        self.gen_used = False
        self.keep_cpu = bool(msg.get("keep_cpu"))
        self.cpu_lost = []
        extra = {"keep_cpu": True} if self.keep_cpu else {}
        # The op's books go in before the first check: with no live rank the
        # clear completes inside _begin (issue 9, sequence 1).
        self._begin(client, msg, "clear", "clearing", now, out, info={"cancelled": cancelled, "freed": 0}, **extra)

    def _resume(self, client: bytes, msg: dict, now: float, out: list[Action]) -> None:
        if self._join_or_busy(client, msg, "resume", now, out):
            return
        if self.state == "running":
            out.append(self._reply(client, msg["req"], "resume", noop=True, state=self.state, epoch=self.epoch, gen=self.gen, note="already running"))
            return
        extra: dict[str, Any] = {}
        if msg.get("layout") is not None:
            if self.state != "cleared":
                out.append(self._error(client, "not_cleared", "a new layout needs cleared caches: run zkv clear first", req=msg["req"]))
                return
            base = self.layout or CacheLayout()
            try:
                new_layout = CacheLayout.from_wire({**base.to_wire(), **msg["layout"]})
            except (P.ProtocolError, TypeError) as err:
                out.append(self._error(client, "bad_field", f"resume layout: {err}", req=msg["req"]))
                return
            extra["layout"] = new_layout.to_wire()
        elif self.layout is not None:
            extra["layout"] = self.layout.to_wire()  # always named: no rank resumes on another layout
        self.retry_at = None
        self._begin(client, msg, "resume", "resuming", now, out, **extra)

    def _begin(self, client: bytes | None, msg: dict, op: str, state: str, now: float, out: list[Action],
               info: dict[str, Any] | None = None, **extra: Any) -> None:
        waiters = [(client, msg["req"])] if client is not None else []
        previous = self.state if self.state != "resuming" else "running"
        self.pending = PendingOp(op, self.epoch + 1, now, now + self._timeout_s(msg), waiters, previous, dict(info or {}))
        self.epoch += 1
        self.control_op = op
        self.control_extra = {k: v for k, v in extra.items() if v is not None}
        self.state = state
        self._publish(now, out)
        self._check_pending(now, out)

    def _publish(self, now: float, out: list[Action]) -> None:
        self.last_publish = now
        upto = [self.ranks[r].dispatched if r in self.ranks else 0 for r in range(self.cfg.world)]
        out.append(Publish(P.encode("control", epoch=self.epoch, op=self.control_op, gen=self.gen, upto=upto, **self.control_extra)))

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

    def _check_pending(self, now: float, out: list[Action]) -> None:
        op = self.pending
        if op is None:
            return
        if any(rs.acked_epoch != op.epoch for rs in self._live_ranks()):
            return
        self.pending = None
        elapsed_ms = round((now - op.started) * 1000, 3)
        fields: dict[str, Any] = {"epoch": op.epoch, "gen": self.gen}
        if op.op == "pause":
            self.state = "paused"
            fields["drain_ms"] = elapsed_ms
        elif op.op == "clear":
            self.state = "cleared"
            fields.update(clear_ms=elapsed_ms, cancelled=op.extra.get("cancelled", 0), freed=op.extra.get("freed", 0))
        else:
            self.state = "running"
            if "layout" in self.control_extra:
                self.layout = CacheLayout.from_wire(self.control_extra["layout"])
            fields["resume_ms"] = elapsed_ms
            if self.layout is not None:
                fields["layout"] = self.layout.to_wire()
            if self.keep_cpu:  # the clear before kept the CPU tier: say whether it survived
                fields["cpu_kept"] = not self.cpu_lost
                if self.cpu_lost:
                    fields["note"] = f"the CPU tier could not be kept on ranks {sorted(set(self.cpu_lost))}: its block shape changed"
                self.keep_cpu = False
                self.control_extra.pop("keep_cpu", None)
            if self.gen_reason:
                fields["gen_reason"] = self.gen_reason
        fields["state"] = self.state
        fields["ranks_acked"] = len(self._live_ranks())
        self.counters[f"{op.op}_ok"] += 1
        if self.recording:
            out.append(Record({"ev": "control", "op": op.op, "t": now, "ok": True, **fields}))
        for client, req in op.waiters:
            out.append(self._reply(client, req, op.op, **fields))
        if self.state == "running":
            self._dispatch(now, out)

    def _fail_pending(self, code: str, reason: str, now: float, out: list[Action]) -> None:
        op = self.pending
        assert op is not None
        self.pending = None
        self.counters[f"{op.op}_failed"] += 1
        if self.recording:
            out.append(Record({"ev": "control", "op": op.op, "t": now, "ok": False, "code": code, "reason": reason}))
        if op.op == "resume":
            reason += f"; the bus is {_STABLE.get(op.previous_state, 'not running')} again (nothing resumed)"
        for client, req in op.waiters:
            out.append(self._error(client, code, reason, req=req))
        if op.op == "pause":
            # Undo the half-done pause: a new epoch that tells every rank to run.
            self.epoch += 1
            self.control_op = "resume"
            self.control_extra = {"layout": self.layout.to_wire()} if self.layout else {}
            self.state = "running"
            self._publish(now, out)
            self._dispatch(now, out)
        elif op.op == "clear":
            self.state = "cleared"  # gen moved on; ranks that lag get repeats
        else:
            self._roll_back_resume(op, now, out)

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
        try:
            P.check_frames(frames, 1, 1)
            msg = P.decode(frames[0], ("ready", "hb", "done", "ack"))
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

    def _done(self, rs: RankState, msg: dict, now: float, out: list[Action]) -> None:
        task = self.inflight.get(msg["seq"])
        if task is None or task.fold is None or not task.fold.add(rs.rank, msg["outcome"], "", msg.get("bytes") or 0):
            self.counters["stray_done"] += 1
            return
        rs.inflight -= 1
        if task.fold.complete:
            del self.inflight[task.seq]
            self._finish_task(task, task.fold.outcome, task.fold.reason, now, out, notify=False)
        self._dispatch(now, out)

    def _ack(self, rs: RankState, msg: dict, now: float, out: list[Action]) -> None:
        if msg["epoch"] != self.epoch or msg["op"] != self.control_op:
            self.counters["stale_acks"] += 1
            return
        if self.control_op == "pause" and msg.get("upto") != rs.dispatched:
            self.counters["stale_acks"] += 1
            return
        if self.control_op == "resume" and "layout" in self.control_extra and msg.get("layout") != self.control_extra["layout"] \
                and (msg.get("layout") is not None or self.layout is None or self.control_extra["layout"] != self.layout.to_wire()):
            self.counters["stale_acks"] += 1  # resumed with another layout: wait for the repeat
            return
        if msg.get("stats"):
            rs.stats = msg["stats"]
        if msg.get("error") and self.control_op == "resume":
            self.counters["alloc_failed"] += 1
            if self.pending is not None and self.pending.op == "resume":
                self._fail_pending("alloc_failed", f"rank {rs.rank} could not allocate its caches for resume epoch {self.epoch}: {msg['error']}", now, out)
            return
        if rs.acked_epoch == self.epoch:
            self.counters["repeat_acks"] += 1
            return
        rs.acked_epoch = self.epoch
        if msg.get("cpu_kept") is False and self.keep_cpu:
            self.cpu_lost.append(rs.rank)
        if self.pending is not None and self.pending.op == "clear":
            self.pending.extra["freed"] = self.pending.extra.get("freed", 0) + (msg.get("freed") or 0)
        self._check_pending(now, out)

    # --- dispatch and task ends ----------------------------------------------------

    def _dispatch(self, now: float, out: list[Action]) -> None:
        if self.state != "running" or not self.queue:
            return
        world = self.cfg.world
        if len(self.ranks) < world:
            return
        ranks = [self.ranks[r] for r in range(world)]
        limit = self.cfg.max_inflight_per_rank
        if not all(rs.alive and rs.welcomed for rs in ranks):
            return
        credits = limit - max(rs.inflight for rs in ranks)
        while credits > 0 and self.queue:
            task = self.queue.popleft()
            if task.expires is not None and now >= task.expires:  # its client gave up on it: never run it late
                self._finish_task(task, "timeout", "the task's timeout_ms passed while it was queued; it never ran", now, out, notify=True)
                continue
            credits -= 1
            self.seq += 1
            task.seq = self.seq
            task.fold = RankFold(world)
            self.inflight[task.seq] = task
            self.gen_used = True
            for rs in ranks:
                rs.inflight += 1
                rs.dispatched += 1
                extra = {"reply_key": task.reply_key} if task.reply_key else {}
                header = P.encode("task", seq=task.seq, n=rs.dispatched, task=task.task, reply_to=task.reply_to, gen=self.gen,
                                  session=rs.session, **extra)
                out.append(ToRank(rs.identity, [header, task.body]))
            self.counters["dispatched"] += 1

    def _finish_task(self, task: Task, outcome: str, reason: str, now: float, out: list[Action], notify: bool) -> None:
        """End a task exactly once at the broker; ``notify`` tells the client."""
        key = (task.client, task.task)
        if key in self.open_tasks:
            self.open_tasks.discard(key)
            self.open_per_client[task.client] -= 1
            if self.open_per_client[task.client] <= 0:
                del self.open_per_client[task.client]
        self.counters[outcome] += 1
        if notify and not task.reported:
            task.reported = True
            out.append(self._outcome(task.client, task.task, outcome, reason))
        if self.recording:
            out.append(Record({"ev": "outcome", "t": now, "client": task.client.hex(), "task": task.task, "outcome": outcome, "reason": reason, "latency_ms": round((now - task.submitted) * 1000, 3)}))

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

    def _expire_joined(self, now: float, out: list[Action]) -> None:
        """A request that joined an op in progress with a shorter timeout gets
        its ``<op>_timeout`` at its own deadline; the op goes on for the rest."""
        op = self.pending
        if op is None:
            return
        for key, deadline in list(op.joined.items()):
            if now >= deadline:
                del op.joined[key]
                op.waiters.remove(key)
                lagging = sorted(rs.rank for rs in self._live_ranks() if rs.acked_epoch != op.epoch)
                out.append(self._error(key[0], f"{op.op}_timeout", f"ranks {lagging} did not acknowledge {op.op} epoch {op.epoch} "
                                       f"within this request's timeout_ms; the {op.op} is still in progress", req=key[1]))

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
            "state": self.state,
            "epoch": self.epoch,
            "gen": self.gen,
            "gen_reason": self.gen_reason,
            "world": self.cfg.world,
            "layout": self.layout.to_wire() if self.layout else None,
            "ranks": [self.ranks[r].to_json(now) for r in sorted(self.ranks)],
            "queued": len(self.queue),
            "inflight": len(self.inflight),
            "max_inflight_per_rank": self.cfg.max_inflight_per_rank,
            "pending_op": self.pending.op if self.pending else None,
            "counters": dict(self.counters),
        }

    def _reply(self, client: bytes, req: int, op: str, **fields: Any) -> ToClient:
        return ToClient(client, [P.encode("reply", req=req, op=op, **fields)])

    def _error(self, client: bytes, code: str, reason: str, **fields: Any) -> ToClient:
        return ToClient(client, [P.encode("error", code=code, reason=reason, **fields)])

    def _outcome(self, client: bytes, task: int, outcome: str, reason: str) -> ToClient:
        return ToClient(client, [P.encode("outcome", task=task, outcome=outcome, reason=reason, gen=self.gen)])


def frames_of(actions: Iterable[Action], kind: type) -> list[Any]:
    """Test helper: the actions of one type, in order."""
    return [a for a in actions if isinstance(a, kind)]
