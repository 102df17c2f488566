"""Tasks through the broker (DESIGN §1, §4): admission of a submit, dispatch
to every rank at once within each rank's credits, the fold of the ranks'
``done`` replies, and the one place a task ends.  A mixin of
:class:`~zkv.broker.core.BrokerCore`; it works on the core's state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..obs.book import BusBook, task_op
from ..wire import fast as F
from ..wire import protocol as P
from ..wire.outcome import RankFold
from .actions import Action, Record, ToRank
from .records import RankState, Task
from .state import CACHES_CLEARED, BusState


class Tasks:
    """Submit, dispatch, done and task ends (mixed into BrokerCore)."""

    if TYPE_CHECKING:  # what the mixin uses of BrokerCore
        cfg: Any
        book: BusBook
        counters: Any
        recording: bool
        state: BusState
        gen: int
        gen_used: bool
        seq: int
        queue: Any
        inflight: dict[int, Task]
        open_tasks: set[tuple[bytes, int]]
        open_per_client: Any
        ranks: dict[int, RankState]
        _error: Any
        _outcome: Any

    def _submit(self, client: bytes, msg: dict, frames: list[bytes], now: float, out: list[Action]) -> None:
        task_id = msg["task"]
        body = frames[1] if len(frames) == 2 else b""
        key = (client, task_id)
        if key in self.open_tasks:  # not a task of its own: an error, no outcome
            self.counters["duplicate_tasks"] += 1
            self.book.bad_request("duplicate_task")
            out.append(self._error(client, "duplicate_task", f"task {task_id} is still open", task=task_id))
            return
        if self.recording:  # every task, also the ones turned away below
            out.append(Record({"ev": "submit", "t": now, "client": client.hex(), "task": task_id, "body": body}))
        reply_to = msg["reply_to"]
        reason = ""
        if len(frames) != 2:
            self.counters["bad_requests"] += 1
            self.book.bad_request("bad_submit")
            reason = "submit needs a header frame and a body frame"
        elif len(body) > P.MAX_FRAME_BYTES:
            self.counters["bad_requests"] += 1
            self.book.bad_request("bad_submit")
            reason = f"task body of {len(body)} bytes exceeds {P.MAX_FRAME_BYTES}"
        elif not P.is_result_address(reply_to):
            self.counters["bad_requests"] += 1
            self.book.bad_request("bad_submit")
            reason = f"reply_to {reply_to[:80]!r} is not an ipc://PATH or tcp://IP:PORT address (numeric IP, at most {P.MAX_ADDRESS} characters)"
        elif self.state in CACHES_CLEARED:
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

    def _dispatch(self, now: float, out: list[Action]) -> None:
        if self.state != BusState.RUNNING or not self.queue:
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
                header = F.encode_task(task.seq, rs.dispatched, task.task, task.reply_to, self.gen, task.reply_key or None, rs.session)
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
        self.book.task_finished(task_op(task.body), outcome, now - task.submitted, task.fold.bytes if task.fold else 0)

