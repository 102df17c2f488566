"""The replay driver: plays a trace's operations through real
:class:`~zkv.client.Client` objects and fills an
:class:`~zkv.replay.checker.Observation`.  Every wait in it is bounded; the
ordering rules are in ``zkv.replay``'s docstring.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import zmq

from ..client import Client, ResultBook, StatusReply, ZkvError
from ..net.curve import Curve
from ..trace import Op, Trace
from ..wire.messages import Result
from ..wire.vocab import BusState, ControlOp, Outcome
from .checker import ControlResult, Key, Observation, Observed, Report, check, rank_stats_fresh


class ObservingBook(ResultBook):
    """A ResultBook that also notices the bus reporting a task twice.

    Allowed: anything after the client itself ended a task (timeout, or the
    cancel that follows a clear), and a surviving rank's result after the
    broker failed a task because another rank died.  Not allowed: a result
    from a rank that already answered, a broker outcome after the task ended,
    or a rank result for a task the broker called cancelled or rejected.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ended: dict[int, str] = {}  # task -> "ranks", "bus:<outcome>" or "client"
        self.anomalies: list[tuple[int, str]] = []

    def on_result(self, msg: Result, now: float):
        task, rank = msg.task, msg.rank
        entry = self.open.get(task)
        if entry is not None:
            if msg.gen >= self.gen and entry.fold is not None and rank not in entry.fold.waiting:
                self.anomalies.append((task, f"rank {rank} reported it twice"))
        else:
            how = self.ended.get(task, "")
            if how == "ranks":
                self.anomalies.append((task, f"rank {rank} reported it after every rank had answered"))
            elif how in ("bus:cancelled", "bus:rejected"):
                self.anomalies.append((task, f"rank {rank} ran it ({msg.outcome}) although the broker said {how[4:]}"))
        out = super().on_result(msg, now)
        if out is not None:
            self.ended[task] = "ranks"
        return out

    def on_outcome(
        self, task: int, outcome: str, reason: str, now: float, gen: int | None = None, ran: bool | None = None
    ):
        if task not in self.open and self.ended.get(task, "client") != "client":
            self.anomalies.append(
                (task, f"the broker reported {outcome} after the task had ended ({self.ended[task]})")
            )
        out = super().on_outcome(task, outcome, reason, now, gen, ran)
        if out is not None:
            self.ended[task] = f"bus:{outcome}"
        return out

    def expire(self, now: float):
        done = super().expire(now)
        for out in done:
            self.ended[out.task] = "client"
        return done

    def cancel_all(self, reason: str, now: float):
        done = super().cancel_all(reason, now)
        for out in done:
            self.ended[out.task] = "client"
        return done


class Replayer:
    """Play a trace through real clients; see the module docstring for ordering."""

    def __init__(
        self,
        trace: Trace,
        address: str,
        *,
        speed: float | None = 1.0,
        task_timeout: float = 30.0,
        op_timeout: float = 30.0,
        stats_wait: float = 3.0,
        ctx: zmq.Context | None = None,
        progress: Callable[[int], None] | None = None,
        curve: Curve | None = None,
    ):
        if speed is not None and speed <= 0:
            raise ValueError("speed must be positive (or None for as fast as possible)")
        self.trace = trace
        self.address = address
        self.speed = speed
        self.task_timeout = task_timeout
        self.op_timeout = op_timeout
        self.stats_wait = stats_wait
        self.ctx = ctx or zmq.Context.instance()
        self.progress = progress
        self.curve = curve
        self.clients: dict[str, Client] = {}
        self.owner: dict[Any, str] = {}  # socket -> client label
        self.poller = zmq.Poller()
        self.keys: dict[tuple[str, int], Key] = {}  # (client label, client task id) -> trace key
        self.dirty: set[str] = set()  # clients that submitted since the last control request
        self.obs = Observation(target=address)

    # -- sockets --

    def _client(self, label: str) -> Client:
        c = self.clients.get(label)
        if c is None:
            c = Client(self.address, ctx=self.ctx, request_timeout=self.op_timeout, curve=self.curve)
            c.book = ObservingBook()
            self.clients[label] = c
            for sock in (c.dealer, c.pull):
                self.poller.register(sock, zmq.POLLIN)
                self.owner[sock] = label
        return c

    def _collect(self, label: str) -> None:
        for out in self.clients[label].poll(0):
            key = self.keys.get((label, out.task))
            if key is not None:
                self.obs.outcomes[key].append(Observed(out.outcome, out.reason, round(out.elapsed_s * 1000, 3)))

    def _next_due(self, now: float) -> float:
        due = [d for d in (c.book.next_deadline() for c in self.clients.values()) if d is not None]
        return max(0.0, min(due) - now) if due else math.inf

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for traffic to any client, and file outcomes."""
        events = dict(self.poller.poll(max(0.0, timeout) * 1000)) if self.clients else {}  # type: ignore[arg-type]  # pyzmq takes float ms
        now = time.monotonic()
        ready = {self.owner[s] for s in events}
        for label, c in self.clients.items():
            if label in ready or c.finished or ((d := c.book.next_deadline()) is not None and d <= now):
                self._collect(label)

    def _wait_until(self, target: float) -> None:
        while (left := target - time.monotonic()) > 0:
            self._pump(min(left, self._next_due(time.monotonic())))

    # -- operations --

    def _submit(self, op: Op) -> None:
        c = self._client(op.client)
        task = c.submit_raw(op.body, self.task_timeout)
        self.keys[(op.client, task)] = op.key
        self.obs.submitted.add(op.key)
        self.dirty.add(op.client)
        self._pump(0)

    def _control(self, op: Op) -> None:
        c = self._client(op.client)
        for label in sorted(self.dirty - {op.client}):
            try:
                self.clients[label].ping(timeout=self.op_timeout)
            except ZkvError as err:
                self.obs.notes.append(f"line {op.line}: ordering barrier ping from client {label} failed: {err.reason}")
        self.dirty.clear()
        timeout = op.params.get("timeout_ms", int(self.op_timeout * 1000)) / 1000
        fields: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            if op.ev == ControlOp.PAUSE:
                reply = c.pause(timeout)
            elif op.ev == ControlOp.CLEAR:
                reply = c.clear(keep_cpu=op.params.get("keep_cpu", False), timeout=timeout)
            else:
                reply = c.resume(op.params.get("layout"), timeout)
            result = "noop" if reply.noop else Outcome.OK
            reason = reply.note
            sent = reply.fields  # the op's fields as the broker sent them
            fields = {
                k: sent[k]
                for k in ("state", "epoch", "gen", "drain_ms", "clear_ms", "resume_ms", "cancelled", "freed")
                if k in sent
            }
            for other in self.clients.values():  # one application: every client learns the generation
                if other is not c and "gen" in sent:
                    other.adopt_gen(reply.gen, f"client {op.client} ran {op.ev}")
        except ZkvError as err:
            result, reason = err.code, err.reason
        wall_ms = (time.perf_counter() - start) * 1000
        self.obs.controls.append(
            ControlResult(op.line, op.ev, op.client, result, reason, round(wall_ms, 3), fields, op.expect)
        )
        for label in self.clients:
            self._collect(label)

    def _status(self, probe: Client, wait: float) -> tuple[StatusReply | None, bool]:
        """The broker status, waiting (bounded) for rank stats that are current."""
        deadline = time.monotonic() + wait
        st: StatusReply | None = None
        while True:
            try:
                st = probe.status(timeout=min(self.op_timeout, max(1.0, wait)))
            except ZkvError as err:
                self.obs.notes.append(f"status failed: {err.reason}" if st is not None else err.reason)
                return st, False
            if rank_stats_fresh(dict(st.fields)):
                return st, True
            left = deadline - time.monotonic()
            if left <= 0:
                return st, False
            # A bounded wait for the next rank heartbeat.  (Not probe.poll():
            # Client.poll can hand zmq a negative timeout, which waits forever.)
            probe.poller.poll(max(1, int(min(0.05, left) * 1000)))

    def run(self) -> Observation:
        obs = self.obs
        with Client(self.address, ctx=self.ctx, request_timeout=self.op_timeout, curve=self.curve) as probe:
            st, _ = self._status(probe, self.stats_wait)
            if st is None:
                raise ZkvError("no_reply", obs.notes.pop() if obs.notes else f"no status reply from {self.address}")
            obs.ranks_before = st.fields["ranks"]  # the checker reads the rank maps as sent
            if st.world != self.trace.world:
                obs.notes.append(f"the trace was made for world {self.trace.world}; the bus has world {st.world}")
            if self.trace.layout is not None and st.layout and st.layout != self.trace.layout:
                obs.notes.append(f"the trace's layout differs from the bus's layout {st.layout.to_wire()}")
            if st.state is not BusState.RUNNING:
                obs.notes.append(f"the bus was {st.state} when the replay started")
            start = time.monotonic()
            try:
                ops = self.trace.ops
                t_first = ops[0].t if ops else 0.0
                for op in ops:
                    if self.speed is not None:
                        self._wait_until(start + (op.t - t_first) / self.speed)
                    if op.ev == "submit":
                        self._submit(op)
                    else:
                        self._control(op)
                    if self.progress is not None:
                        self.progress(1)
                guard = time.monotonic() + self.task_timeout + self.op_timeout
                while any(c.book.open for c in self.clients.values()) and (now := time.monotonic()) < guard:
                    self._pump(min(guard - now, self._next_due(now)))
                for label in self.clients:
                    self._collect(label)
                obs.duration_s = time.monotonic() - start
                for label, c in self.clients.items():
                    book = c.book
                    assert isinstance(book, ObservingBook)
                    for task, message in book.anomalies:
                        obs.anomalies.append((self.keys.get((label, task), (label, f"#{task}")), message))
                    obs.late_messages += sum(
                        book.counters[k] for k in ("late_results", "late_outcomes", "stale_results")
                    )
            finally:
                for c in self.clients.values():
                    c.close()
            st, obs.stats_fresh = self._status(probe, self.stats_wait)
            obs.ranks_after = st.fields["ranks"] if st else None
        return obs


def parse_speed(text: str | float | None) -> float | None:
    """``max`` (as fast as possible) -> None; ``1``, ``2.5``, ``0.5x`` -> the factor."""
    if text is None:
        return 1.0
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        t = text.strip().lower()
        if t in ("max", "inf", "0"):
            return None
        try:
            value = float(t[:-1] if t.endswith("x") else t)
        except ValueError:
            raise ValueError(f"speed must be 'max' or a positive factor like 1, 2.5 or 10x, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"speed must be 'max' or a positive factor, got {text!r}")
    return value


def replay(trace: Trace, address: str, **kwargs: Any) -> Report:
    """Replay against a running broker and check."""
    return check(trace, Replayer(trace, address, **kwargs).run())
