"""Tasks through the broker (docs/protocol.md §7): admission of a submit
within the per-client bounds, dispatch to every rank at once within each
rank's credits, the fold of the ranks' ``done`` replies, and the one place a
task ends.  Whether the bus may run tasks at all is the control machine's to
say (``control.py``): the caller asks it, and passes the answer in."""

from __future__ import annotations

import collections
import heapq
import itertools

from ..obs.book import BusBook, task_op
from ..wire import protocol as P
from ..wire.messages import Cancel, Done, Submit
from ..wire.messages import Task as TaskMsg
from ..wire.outcome import RankFold
from ..wire.replies import CancelReply
from ..wire.vocab import Outcome, TaskState
from .actions import Action, Record, ToRank, answer_to, error, outcome
from .generation import Generation
from .ranks import RankTable
from .records import BrokerConfig, RankState, Task

_NEVER_RAN = "the task's timeout_ms passed while it was queued: it was never dispatched and never ran"
CANCELLED_BY_CLIENT = "cancelled by its client before it was dispatched"
_MAX_ENDED = 65536  # the ended tasks a cancel can still name as ``done``, over every connection


class TaskTable:
    """Queued and in-flight tasks, the tasks each connection holds open, and
    the dispatch sequence."""

    def __init__(self, cfg: BrokerConfig, book: BusBook, recording: bool, ranks: RankTable, gens: Generation):
        self.cfg = cfg
        self.book = book
        self.counters = book.events
        self.recording = recording
        self.ranks = ranks
        self.gens = gens
        self.queue: collections.deque[Task] = collections.deque()
        # Queued tasks with a submit timeout_ms, by deadline: the broker wakes
        # for the earliest and ends it then (``expire``), never later.  An
        # expired task leaves the queue lazily (``stale`` of them are in it).
        self.expiring: list[tuple[float, int, Task]] = []
        self._order = itertools.count()
        self.stale = 0
        self.inflight: dict[int, Task] = {}
        self.open_tasks: dict[tuple[bytes, int], Task] = {}
        # Recently ended tasks, oldest first: a cancel that comes too late says ``done``.
        self.ended: collections.OrderedDict[tuple[bytes, int], None] = collections.OrderedDict()
        self.open_per_client: collections.Counter[bytes] = collections.Counter()
        self.seq = 0

    def submit(
        self, client: bytes, msg: Submit, frames: list[bytes], cleared: bool, now: float, out: list[Action]
    ) -> bool:
        """Queue a task, or end it ``rejected``; ``cleared``: the caches are
        cleared.  True when it was queued (the caller dispatches)."""
        task_id = msg.task
        body = frames[1] if len(frames) == 2 else b""
        key = (client, task_id)
        if key in self.open_tasks:  # not a task of its own: an error, no outcome
            self.book.bad_request("duplicate_task")
            out.append(error(client, "duplicate_task", f"task {task_id} is still open", task=task_id))
            return False
        if self.recording:  # every task, also the ones turned away below
            out.append(Record({"ev": "submit", "t": now, "client": client.hex(), "task": task_id, "body": body}))
        reply_to = msg.reply_to
        reason = ""
        if len(frames) != 2:
            self.book.bad_request("bad_submit")
            reason = "submit needs a header frame and a body frame"
        elif len(body) > P.MAX_FRAME_BYTES:
            self.book.bad_request("bad_submit")
            reason = f"task body of {len(body)} bytes exceeds {P.MAX_FRAME_BYTES}"
        elif not P.is_result_address(reply_to):
            self.book.bad_request("bad_submit")
            reason = (
                f"reply_to {reply_to[:80]!r} is not an ipc://PATH or tcp://IP:PORT address "
                f"(numeric IP, at most {P.MAX_ADDRESS} characters)"
            )
        elif cleared:
            reason = "caches are cleared; resume the bus first (zkv resume)"
        elif self.queued() >= self.cfg.max_queue:
            reason = f"queue full ({self.cfg.max_queue} tasks); retry later"
        elif self.open_per_client[client] >= self.cfg.max_open_per_client:
            self.counters["over_limit"] += 1
            reason = (
                f"this connection has {self.cfg.max_open_per_client} open tasks (the most it may); wait for some to end"
            )
        timeout_ms = msg.timeout_ms
        expires = now + timeout_ms / 1000 if timeout_ms else None
        task = Task(
            client,
            task_id,
            reply_to,
            body,
            now,
            msg.reply_key,
            expires,
            gen=self.gens.gen,
            batch_results=msg.batch_results is True,
        )
        if reason:
            self.finish(task, Outcome.REJECTED, reason, now, out, notify=True)
            return False
        self.open_tasks[key] = task
        self.open_per_client[client] += 1
        self.queue.append(task)
        if expires is not None:
            heapq.heappush(self.expiring, (expires, next(self._order), task))
        self.counters["submitted"] += 1
        return True

    def queued(self) -> int:
        """Tasks waiting in the queue (the expired ones it still holds are not)."""
        return len(self.queue) - self.stale

    def compact(self) -> collections.deque[Task]:
        """The queue without the expired tasks it still holds."""
        if self.stale:
            self.queue = collections.deque(t for t in self.queue if not t.reported)
            self.stale = 0
        return self.queue

    def expire(self, now: float, out: list[Action]) -> None:
        """End every queued task whose submit ``timeout_ms`` passed: ``timeout``,
        never dispatched (docs/protocol.md §7.6), whatever state the bus is in."""
        heap = self.expiring
        while heap and heap[0][0] <= now:
            task = heapq.heappop(heap)[2]
            if task.seq == 0 and not task.reported:  # still queued
                self.finish(task, Outcome.TIMEOUT, _NEVER_RAN, now, out, notify=True)
                self.stale += 1
        if self.stale > len(self.queue) // 2:
            self.compact()

    def deadline(self) -> float:
        """When the next queued task expires (inf: none)."""
        heap = self.expiring
        while heap and (heap[0][2].seq or heap[0][2].reported):  # dispatched or ended meanwhile
            heapq.heappop(heap)
        if len(heap) > 2 * self.queued() + 64:  # bound what dispatched tasks leave behind
            self.expiring = heap = [e for e in heap if not (e[2].seq or e[2].reported)]
            heapq.heapify(heap)
        return heap[0][0] if heap else float("inf")

    def done(self, rs: RankState, msg: Done, now: float, out: list[Action]) -> bool:
        """Fold a rank's ``done``; True when it freed a credit (the caller dispatches)."""
        task = self.inflight.get(msg.seq)
        if task is None or task.fold is None or not task.fold.add(rs.rank, msg.outcome, "", msg.bytes or 0):
            self.counters["stray_done"] += 1
            return False
        rs.inflight -= 1
        if task.fold.complete:
            del self.inflight[task.seq]
            self.finish(task, task.fold.outcome, task.fold.reason, now, out, notify=False)
        return True

    def dispatch(self, now: float, out: list[Action]) -> None:
        """Send queued tasks to every rank while each has a credit; only for a
        running bus (the caller checks)."""
        if not self.queue:
            return
        world = self.cfg.world
        table = self.ranks.ranks
        if len(table) < world:
            return
        ranks = [table[r] for r in range(world)]
        limit = self.cfg.max_inflight_per_rank
        if not all(rs.alive and rs.welcomed for rs in ranks):
            return
        credits = limit - max(rs.inflight for rs in ranks)
        gen, cpu_gen = self.gens.gen, self.gens.cpu_gen
        sent = 0
        while credits > 0 and self.queue:
            task = self.queue.popleft()
            if task.reported:  # expired while queued
                self.stale -= 1
                continue
            if task.expires is not None and now >= task.expires:  # due, and the clock has not run yet
                self.finish(task, Outcome.TIMEOUT, _NEVER_RAN, now, out, notify=True)
                continue
            credits -= 1
            self.seq += 1
            task.seq = self.seq
            task.gen = gen
            task.fold = RankFold(world)
            self.inflight[task.seq] = task
            for rs in ranks:
                rs.inflight += 1
                rs.dispatched += 1
                header = TaskMsg(
                    seq=task.seq,
                    n=rs.dispatched,
                    task=task.task,
                    reply_to=task.reply_to,
                    gen=gen,
                    reply_key=task.reply_key or None,
                    session=rs.session,
                    cpu_gen=cpu_gen,
                    batch_results=task.batch_results or None,  # absent when false: the header a client without it got
                ).to_wire()
                out.append(ToRank(rs.identity, [header, task.body]))
            sent += 1
        if sent:
            self.gens.mark_used()
            self.counters["dispatched"] += sent

    def cancel(self, client: bytes, msg: Cancel, now: float, out: list[Action]) -> None:
        """A client's cancel of one of its tasks (docs/protocol.md §7.6): a queued
        one ends ``cancelled`` now, before the reply; a dispatched one runs to
        its own outcome; the reply says which (``state``)."""
        key = (client, msg.task)
        task = self.open_tasks.get(key)
        if task is None:
            state = TaskState.DONE if key in self.ended else TaskState.UNKNOWN
        elif task.seq:
            state = TaskState.DISPATCHED
        else:
            state = TaskState.QUEUED
            self.finish(task, Outcome.CANCELLED, CANCELLED_BY_CLIENT, now, out, notify=True)
            self.counters["client_cancels"] += 1
            self.stale += 1  # it leaves the queue lazily, as an expired one
            if self.stale > len(self.queue) // 2:
                self.compact()
        out.append(answer_to(client, CancelReply(msg.req, task=msg.task, cancelled=state == "queued", state=state)))

    def cancel_queued(self, reason: str, now: float, out: list[Action]) -> int:
        """End every queued task ``cancelled`` (caches cleared, generation moved)."""
        cancelled = 0
        for task in self.compact():
            cancelled += 1
            self.finish(task, Outcome.CANCELLED, reason, now, out, notify=True)
        self.queue.clear()
        return cancelled

    def fail_rank(self, rs: RankState, reason: str, now: float, out: list[Action]) -> None:
        """A rank was lost: each task waiting on it fails now, never hangs."""
        for seq, task in list(self.inflight.items()):
            if task.fold is None or rs.rank not in task.fold.waiting:
                continue
            task.fold.waiting.discard(rs.rank)
            task.fold.fail(Outcome.FAILED, reason)
            if not task.reported:
                task.reported = True
                out.append(outcome(task.client, task.task, Outcome.FAILED, reason, task.gen))
            if task.fold.complete:
                del self.inflight[seq]
                self.finish(task, Outcome.FAILED, reason, now, out, notify=False)
        rs.inflight = 0

    def finish(self, task: Task, result: str, reason: str, now: float, out: list[Action], notify: bool) -> None:
        """End a task exactly once at the broker; ``notify`` tells the client."""
        key = (task.client, task.task)
        if self.open_tasks.pop(key, None) is not None:
            self.open_per_client[task.client] -= 1
            if self.open_per_client[task.client] <= 0:
                del self.open_per_client[task.client]
            ended = self.ended
            ended[key] = None
            if len(ended) > _MAX_ENDED:
                ended.popitem(last=False)
        self.counters[result] += 1
        if notify and not task.reported:
            task.reported = True  # never dispatched: the outcome says no rank ran it (docs/protocol.md §7.3)
            out.append(outcome(task.client, task.task, result, reason, task.gen, ran=False if not task.seq else None))
        if self.recording:
            out.append(
                Record(
                    {
                        "ev": "outcome",
                        "t": now,
                        "client": task.client.hex(),
                        "task": task.task,
                        "outcome": result,
                        "reason": reason,
                        "latency_ms": round((now - task.submitted) * 1000, 3),
                    }
                )
            )
        self.book.task_finished(task_op(task.body), result, now - task.submitted, task.fold.bytes if task.fold else 0)
