"""Today's broker core and rank worker with the metric hooks attached.

The hooks of ``zkv.obs.book`` belong inside ``BrokerCore`` and the rank's
executor (one call each where a task ends, a rank's ``done`` is folded, a
control op completes, a bad request is refused: docs/operations.md lists
the lines).  Until they move there, these subclasses attach them around the
same methods, so a real broker and real ranks export real metrics now:

    broker.core = MeteredBrokerCore(config, recording=...)   # before serve()
    worker = MeteredRankWorker(rank, world, backend, control, layout, ...)  # zkv.harness.metered_rank
"""

from __future__ import annotations

from typing import Any

from ..wire import protocol as P
from ..broker.core import BrokerConfig, BrokerCore, Task, ToClient
from ..obs.book import BusBook, task_op


class MeteredBrokerCore(BrokerCore):
    """A :class:`BrokerCore` that books tasks, bytes and control ops in ``self.book``."""

    def __init__(self, config: BrokerConfig | None = None, recording: bool = False, book: BusBook | None = None):
        super().__init__(config, recording)
        self.book = book or BusBook()

    # task ends: every path (rank results, rejected, cancelled, rank died) goes through here;
    # the one per-task hook
    def _finish_task(self, task: Task, outcome: str, reason: str, now: float, out: list, notify: bool) -> None:
        super()._finish_task(task, outcome, reason, now, out, notify)
        self.book.task_finished(task_op(task.body), outcome, now - task.submitted, task.fold.bytes if task.fold else 0)

    # control ops: completed, failed, or answered at once (noop / refused)
    def _check_pending(self, now: float, out: list) -> None:
        op = self.pending
        super()._check_pending(now, out)
        if op is not None and self.pending is not op:
            self.book.control_finished(op.op, "ok", now - op.started)

    def _fail_pending(self, code: str, reason: str, now: float, out: list) -> None:
        op = self.pending
        super()._fail_pending(code, reason, now, out)
        if op is not None:
            self.book.control_finished(op.op, code, now - op.started)

    def _pause(self, client: bytes, msg: dict, now: float, out: list) -> None:
        self._control(super()._pause, "pause", client, msg, now, out)

    def _clear(self, client: bytes, msg: dict, now: float, out: list) -> None:
        self._control(super()._clear, "clear", client, msg, now, out)

    def _resume(self, client: bytes, msg: dict, now: float, out: list) -> None:
        self._control(super()._resume, "resume", client, msg, now, out)

    def _control(self, handler: Any, op: str, client: bytes, msg: dict, now: float, out: list) -> None:
        start, epoch = len(out), self.epoch
        handler(client, msg, now, out)
        if self.epoch != epoch:
            return  # an op began: booked when it completes or fails
        for action in out[start:]:  # answered at once: a noop or a refusal (rare: decoding is fine)
            if isinstance(action, ToClient):
                reply = P.decode(action.frames[0])
                if reply.get("kind") == "error":
                    self.book.control_finished(op, reply["code"])
                elif reply.get("noop"):
                    self.book.control_finished(op, "noop")
                return  # joining a pending op of the same kind sends nothing yet

    # bad input
    def on_client(self, client: bytes, frames: list[bytes], now: float) -> list:
        counters = self.counters  # .get: a missing key of a Counter costs a Python-level __missing__ call
        bad, dup = counters.get("bad_requests", 0), counters.get("duplicate_tasks", 0)
        out = super().on_client(client, frames, now)
        if counters.get("duplicate_tasks", 0) != dup:
            self.book.bad_request("duplicate_task")
        elif counters.get("bad_requests", 0) != bad:
            msg = P.decode(out[0].frames[0]) if out and isinstance(out[0], ToClient) else {}
            self.book.bad_request(msg["code"] if msg.get("kind") == "error" else "bad_submit")
        return out
