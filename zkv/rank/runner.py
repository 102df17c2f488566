"""Running one task on a rank's cache: check, copy, send the result.

Both threads of a rank run tasks through a :class:`TaskRunner`: the
executor thread for work queued behind other work, and the I/O thread itself
for a small task when nothing is queued (handing a 1-block copy to
another thread cost two thread wake-ups, a report message and the GIL's
hand-overs, several times the copy).  Either way only one thread runs a
task at a time (the I/O thread runs one only while the executor's queue is
empty), so tasks keep their FIFO order with cache frees and allocations.

ZMQ sockets are never shared between threads: each thread owns its own
:class:`ResultSenders`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..obs.book import RankBook
from ..wire import fast as F
from ..wire import protocol as P
from ..wire.messages import Result
from ..wire.moves import KEYED_MOVES, MOVES
from ..wire.vocab import Op, RankOutcome
from .actions import Execute
from .errors import CacheError
from .reports import Finished
from .result_links import ResultSenders
from .store import BlockStore, TaskInvalid

log = logging.getLogger("zkv.worker")

# module names: an enum member read costs ~0.1 us (3.11)
_OK, _FAILED, _FILL = RankOutcome.OK, RankOutcome.FAILED, Op.FILL
_KEYED = frozenset(KEYED_MOVES)  # put / get: the keyed store named by keys


@dataclass(slots=True)
class Ran:
    """A task between its checks and its result: ``body`` while checked and not yet run,
    then what its result will say."""

    ex: Execute
    start: float
    op: Op | str = ""
    body: P.TaskBody | None = None
    outcome: RankOutcome = _OK
    reason: str = ""
    nbytes: int = 0
    digests: list[bytes] | None = None

    def fail(self, reason: str) -> None:
        """The task failed: it moved nothing and has nothing left to run."""
        self.outcome, self.reason, self.nbytes, self.body = _FAILED, reason, 0, None


class TaskRunner:
    """Runs tasks on ``cache`` (the rank's ``BlockStore``) and books what the
    copy did (bytes, copy times) in the executor's counters; the task's outcome
    is the core's to count (``RankCore.on_finished``), once per process.

    ``session``: the rank's current registration session (read at run time: a
    task queued before a re-registration must not copy)."""

    def __init__(
        self,
        cache: BlockStore,
        rank: int,
        world: int,
        stats: collections.Counter[str],
        book: RankBook,
        paused_ack: threading.Event,
        session: Callable[[], int],
    ):
        self.cache = cache
        self.rank = rank
        self.world = world
        self.stats = stats
        self.book = book
        self.paused_ack = paused_ack
        self.session = session
        # An engine's hook for "this rank's copy of task T is over" (RankAgent's on_task_done).
        self.on_done: Callable[[int, str], None] | None = None

    def run(self, ex: Execute, senders: ResultSenders) -> Finished:
        """Check and run ``ex``, send its result to the client, and return
        what the core books.  Never raises: a copy that blows up fails the task."""
        return self.finish(self.execute(self.check(ex)), senders)

    def check(self, ex: Execute) -> Ran:
        """Everything before the copy: the refusal, the session, the body, the CPU
        generation, the ids.  A task that fails them is over (``Ran.body`` None);
        one that passes is ``execute``d (or run in a group).  Never raises."""
        ran = Ran(ex, time.perf_counter())
        try:
            if ex.refuse:
                raise TaskInvalid(ex.refuse)
            if ex.session != self.session():
                # We re-registered since: the broker already failed this task,
                # so it must not copy into blocks its client may have reused.
                self.stats["dropped_stale_session"] += 1
                raise TaskInvalid("the rank re-registered after this task was dispatched; dropped")
            body = F.decode_body(ex.body)
            ran.op = body.op
            if ex.cpu_gen is not None and ex.cpu_gen != self.cache.cpu_gen:
                self.cache.set_cpu_gen(ex.cpu_gen)  # before any row is read or sealed at it
            self.cache.validate(body)
            if self.paused_ack.is_set():
                self.stats["copies_after_ack"] += 1  # must stay 0: the invariant under test
            ran.body = body
        except Exception as err:  # noqa: BLE001 - every task ends in a result
            self._failed(ran, err)
        return ran

    def execute(self, ran: Ran) -> Ran:
        """Run a checked task's copy (nothing for one that failed its checks)."""
        body, ran.body = ran.body, None
        if body is None:
            return ran
        try:
            op = body.op
            if op in _KEYED:  # the store lane's (executor.Lanes): its I/O waits on the store
                ran.nbytes = self.cache.move_keyed(op, body)
            elif op in MOVES:  # a spill never runs on the I/O thread (batching.InlinePolicy): it waits on the device
                ran.nbytes = self.cache.move(op, body.src, body.dst)
            elif op == _FILL:
                ran.nbytes = self.cache.fill(body.tier, body.dst, body.seed)
            else:
                ran.digests = self.cache.checksum(body.tier, body.src)
        except Exception as err:  # noqa: BLE001 - a copy that blew up must still end the task
            self._failed(ran, err)
        return ran

    def execute_group(self, group: list[Ran]) -> None:
        """Run checked disk moves of one op (all spills or all loads, no destination twice)
        in one pass (``BlockStore.move_group``); each keeps its own outcome."""
        ends: list[int | CacheError] | list[Exception]
        try:
            ends = self.cache.move_group(group[0].op, [(r.body.src, r.body.dst) for r in group])  # type: ignore[union-attr]
        except Exception as err:  # noqa: BLE001 - a bug fails the group's tasks, never the thread
            ends = [err] * len(group)
        for ran, end in zip(group, ends):
            ran.body = None
            if isinstance(end, int):
                ran.nbytes = end
            else:
                self._failed(ran, end)

    def _failed(self, ran: Ran, err: Exception) -> None:
        """Fail ``ran`` with ``err``: a refusal the peer should read as it is, else a bug, logged."""
        if isinstance(err, (P.ProtocolError, TaskInvalid, CacheError)):
            ran.fail(str(err))  # a ProtocolError reads "code: reason", the §9 code first
            return
        log.error("task %s failed", ran.ex.task, exc_info=err)
        ran.fail(f"{type(err).__name__}: {err}")

    def finish(self, ran: Ran, senders: ResultSenders) -> Finished:
        """Send a task's result to the client (or hand it to ``senders`` to hold for
        the client's next batch), book it, and return what the core books."""
        ex, outcome, nbytes = ran.ex, ran.outcome, ran.nbytes
        elapsed = time.perf_counter() - ran.start  # a task run in a group: until its group's end
        if outcome is _OK:
            self.book.task_done(ran.op, elapsed, nbytes)
        self.stats["bytes_moved"] += nbytes
        senders.post(
            ex.reply_to,
            ex.reply_key,
            Result(
                task=ex.task,
                rank=self.rank,
                world=self.world,
                outcome=outcome,
                reason=ran.reason[:1000],  # a result must stay within the peer's string bound (P.MAX_STR)
                gen=ex.gen,
                bytes=nbytes,
                elapsed_us=int(elapsed * 1e6),
                digests=ran.digests,
                cpu_gen=ex.cpu_gen,
            ).to_wire(),
            ex.batch_results,
        )
        if self.on_done is not None:
            try:
                self.on_done(ex.task, outcome)
            except Exception:  # noqa: BLE001 - the engine's hook must not end the rank's thread
                log.exception("on_task_done hook failed for task %s", ex.task)
        return Finished(ex.seq, ex.n, outcome, nbytes, ex.gen)
