"""Control operations (DESIGN §2, §5): pause, clear and resume requests,
joining or refusing a request while one is in progress, publishing the
control message at each epoch, counting the ranks' acks, and the success or
failure that ends an operation.  A mixin of
:class:`~zkv.broker.core.BrokerCore`; the states it moves the bus between
are looked up in ``state.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..obs.book import BusBook
from ..wire import protocol as P
from ..wire.layout import CacheLayout
from .actions import Action, Publish, Record
from .records import PendingOp, RankState
from .state import ALREADY, IN_PROGRESS, ON_SUCCESS, STABLE, BusState, ControlOp, on_failure


class Control:
    """Pause, clear, resume and their acks (mixed into BrokerCore)."""

    if TYPE_CHECKING:  # what the mixin uses of BrokerCore
        cfg: Any
        book: BusBook
        counters: Any
        recording: bool
        state: BusState
        epoch: int
        gen: int
        gen_used: bool
        gen_reason: str
        keep_cpu: bool
        cpu_lost: list[int]
        retry_at: float | None
        layout: CacheLayout | None
        control_op: ControlOp
        control_extra: dict[str, Any]
        pending: PendingOp | None
        ranks: dict[int, RankState]
        queue: Any
        last_publish: float
        _reply: Any
        _error: Any
        _dispatch: Any
        _finish_task: Any
        _live_ranks: Any
        _roll_back_resume: Any

    def _timeout_s(self, msg: dict) -> float:
        return (msg.get("timeout_ms") or self.cfg.op_timeout_ms) / 1000.0

    def _join_or_busy(self, client: bytes, msg: dict, op: ControlOp, now: float, out: list[Action]) -> bool:
        """A request during a pending op: join it if same op, else say busy."""
        if self.pending is None:
            return False
        if self.pending.op == op:
            self.pending.waiters.append((client, msg["req"]))
            mine = now + self._timeout_s(msg)
            if mine < self.pending.deadline:  # answered by its own deadline, even if the op goes on
                self.pending.joined[(client, msg["req"])] = mine
        else:
            self.book.control_finished(op, "busy")
            out.append(self._error(client, "busy", f"{self.pending.op} epoch {self.pending.epoch} is in progress; retry when it completes", req=msg["req"]))
        return True

    def _pause(self, client: bytes, msg: dict, now: float, out: list[Action]) -> None:
        if self._join_or_busy(client, msg, ControlOp.PAUSE, now, out):
            return
        if self.state in ALREADY[ControlOp.PAUSE]:
            self.book.control_finished("pause", "noop")
            out.append(self._reply(client, msg["req"], ControlOp.PAUSE, noop=True, state=self.state, epoch=self.epoch, gen=self.gen, drain_ms=0.0, note=f"already {self.state}"))
            return
        self._begin(client, msg, ControlOp.PAUSE, now, out)

    def _clear(self, client: bytes, msg: dict, now: float, out: list[Action]) -> None:
        if self._join_or_busy(client, msg, ControlOp.CLEAR, now, out):
            return
        if self.state in ALREADY[ControlOp.CLEAR]:
            self.book.control_finished("clear", "noop")
            out.append(self._reply(client, msg["req"], ControlOp.CLEAR, noop=True, state=self.state, epoch=self.epoch, gen=self.gen, cancelled=0, freed=0, note="already cleared"))
            return
        if self.state != BusState.PAUSED:
            self.book.control_finished("clear", "not_paused")
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
        self._begin(client, msg, ControlOp.CLEAR, now, out, info={"cancelled": cancelled, "freed": 0}, **extra)

    def _resume(self, client: bytes, msg: dict, now: float, out: list[Action]) -> None:
        if self._join_or_busy(client, msg, ControlOp.RESUME, now, out):
            return
        if self.state in ALREADY[ControlOp.RESUME]:
            self.book.control_finished("resume", "noop")
            out.append(self._reply(client, msg["req"], ControlOp.RESUME, noop=True, state=self.state, epoch=self.epoch, gen=self.gen, note="already running"))
            return
        extra: dict[str, Any] = {}
        if msg.get("layout") is not None:
            if self.state != BusState.CLEARED:
                self.book.control_finished("resume", "not_cleared")
                out.append(self._error(client, "not_cleared", "a new layout needs cleared caches: run zkv clear first", req=msg["req"]))
                return
            base = self.layout or CacheLayout()
            try:
                new_layout = CacheLayout.from_wire({**base.to_wire(), **msg["layout"]})
            except (P.ProtocolError, TypeError) as err:
                self.book.control_finished("resume", "bad_field")
                out.append(self._error(client, "bad_field", f"resume layout: {err}", req=msg["req"]))
                return
            extra["layout"] = new_layout.to_wire()
        elif self.layout is not None:
            extra["layout"] = self.layout.to_wire()  # always named: no rank resumes on another layout
        self.retry_at = None
        self._begin(client, msg, ControlOp.RESUME, now, out, **extra)

    def _begin(self, client: bytes | None, msg: dict, op: ControlOp, now: float, out: list[Action],
               info: dict[str, Any] | None = None, **extra: Any) -> None:
        waiters = [(client, msg["req"])] if client is not None else []
        # A resume the broker started itself began from a running bus.
        previous = self.state if self.state != BusState.RESUMING else BusState.RUNNING
        self.pending = PendingOp(op, self.epoch + 1, now, now + self._timeout_s(msg), waiters, previous, dict(info or {}))
        self.epoch += 1
        self.control_op = op
        self.control_extra = {k: v for k, v in extra.items() if v is not None}
        self.state = IN_PROGRESS[op]
        self._publish(now, out)
        self._check_pending(now, out)

    def _publish(self, now: float, out: list[Action]) -> None:
        self.last_publish = now
        upto = [self.ranks[r].dispatched if r in self.ranks else 0 for r in range(self.cfg.world)]
        out.append(Publish(P.encode("control", epoch=self.epoch, op=self.control_op, gen=self.gen, upto=upto, **self.control_extra)))

    def _check_pending(self, now: float, out: list[Action]) -> None:
        op = self.pending
        if op is None:
            return
        if any(rs.acked_epoch != op.epoch for rs in self._live_ranks()):
            return
        self.pending = None
        self.book.control_finished(op.op, "ok", now - op.started)
        elapsed_ms = round((now - op.started) * 1000, 3)
        fields: dict[str, Any] = {"epoch": op.epoch, "gen": self.gen}
        self.state = ON_SUCCESS[op.op]
        if op.op == ControlOp.PAUSE:
            fields["drain_ms"] = elapsed_ms
        elif op.op == ControlOp.CLEAR:
            fields.update(clear_ms=elapsed_ms, cancelled=op.extra.get("cancelled", 0), freed=op.extra.get("freed", 0))
        else:
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
        if self.state == BusState.RUNNING:
            self._dispatch(now, out)

    def _fail_pending(self, code: str, reason: str, now: float, out: list[Action]) -> None:
        op = self.pending
        assert op is not None
        self.pending = None
        self.book.control_finished(op.op, code, now - op.started)
        self.counters[f"{op.op}_failed"] += 1
        if self.recording:
            out.append(Record({"ev": "control", "op": op.op, "t": now, "ok": False, "code": code, "reason": reason}))
        if op.op == ControlOp.RESUME:
            reason += f"; the bus is {STABLE.get(op.previous_state, 'not running')} again (nothing resumed)"
        for client, req in op.waiters:
            out.append(self._error(client, code, reason, req=req))
        if op.op == ControlOp.PAUSE:
            # Undo the half-done pause: a new epoch that tells every rank to run.
            self.epoch += 1
            self.state, self.control_op = on_failure(op.op, op.previous_state)
            self.control_extra = {"layout": self.layout.to_wire()} if self.layout else {}
            self._publish(now, out)
            self._dispatch(now, out)
        elif op.op == ControlOp.CLEAR:
            self.state, self.control_op = on_failure(op.op, op.previous_state)  # gen moved on; laggards get repeats
        else:
            self._roll_back_resume(op, now, out)

    def _ack(self, rs: RankState, msg: dict, now: float, out: list[Action]) -> None:
        if msg["epoch"] != self.epoch or msg["op"] != self.control_op:
            self.counters["stale_acks"] += 1
            return
        if self.control_op == ControlOp.PAUSE and msg.get("upto") != rs.dispatched:
            self.counters["stale_acks"] += 1
            return
        if self.control_op == ControlOp.RESUME and "layout" in self.control_extra and msg.get("layout") != self.control_extra["layout"] \
                and (msg.get("layout") is not None or self.layout is None or self.control_extra["layout"] != self.layout.to_wire()):
            self.counters["stale_acks"] += 1  # resumed with another layout: wait for the repeat
            return
        if msg.get("stats"):
            rs.stats = msg["stats"]
        if msg.get("error") and self.control_op == ControlOp.RESUME:
            self.counters["alloc_failed"] += 1
            if self.pending is not None and self.pending.op == ControlOp.RESUME:
                self._fail_pending("alloc_failed", f"rank {rs.rank} could not allocate its caches for resume epoch {self.epoch}: {msg['error']}", now, out)
            return
        if rs.acked_epoch == self.epoch:
            self.counters["repeat_acks"] += 1
            return
        rs.acked_epoch = self.epoch
        if msg.get("cpu_kept") is False and self.keep_cpu:
            self.cpu_lost.append(rs.rank)
        if self.pending is not None and self.pending.op == ControlOp.CLEAR:
            self.pending.extra["freed"] = self.pending.extra.get("freed", 0) + (msg.get("freed") or 0)
        self._check_pending(now, out)

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

