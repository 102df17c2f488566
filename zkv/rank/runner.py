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
from ..wire.moves import MOVES
from ..wire.vocab import Op, RankOutcome
from .actions import Execute
from .cache.errors import CacheError
from .cache.store import BlockStore, TaskInvalid
from .reports import Finished
from .result_links import ResultSenders

log = logging.getLogger("zkv.worker")

# module names: an enum member read costs ~0.1 us (3.11)
_OK, _FAILED, _FILL, _SPILL = RankOutcome.OK, RankOutcome.FAILED, Op.FILL, Op.SPILL


@dataclass
class Ran:
    """A task run and not yet reported (``TaskRunner.start``): what its result will say.
    ``held``: a spill whose blocks wait for the store's commit."""

    ex: Execute
    start: float
    outcome: RankOutcome
    reason: str
    nbytes: int
    digests: list[bytes] | None
    op: Op | str
    held: bool

    def fail(self, reason: str) -> None:
        """The commit its blocks waited for failed: the task did not happen."""
        self.outcome, self.reason, self.nbytes, self.held = _FAILED, reason, 0, False


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
        return self.finish(self.start(ex), senders)

    def start(self, ex: Execute, durable: bool = True) -> Ran:
        """Check and run ``ex`` without sending its result.  ``durable=False``: a spill's
        blocks wait for the store's ``commit`` (``Ran.held``), which the caller makes
        before it ``finish``es the task.  Never raises."""
        start = time.perf_counter()
        outcome, reason, nbytes, digests, op = _OK, "", 0, None, ""
        try:
            if ex.refuse:
                raise TaskInvalid(ex.refuse)
            if ex.session != self.session():
                # We re-registered since: the broker already failed this task,
                # so it must not copy into blocks its client may have reused.
                self.stats["dropped_stale_session"] += 1
                raise TaskInvalid("the rank re-registered after this task was dispatched; dropped")
            body = F.decode_body(ex.body)
            op = body.op
            if ex.cpu_gen is not None and ex.cpu_gen != self.cache.cpu_gen:
                self.cache.set_cpu_gen(ex.cpu_gen)  # before any row is read or sealed at it
            self.cache.validate(body)
            if self.paused_ack.is_set():
                self.stats["copies_after_ack"] += 1  # must stay 0: the invariant under test
            if op in MOVES:  # a spill never runs on the I/O thread (batching.InlinePolicy): it waits on the device
                nbytes = self.cache.move(op, body.src, body.dst, durable)
            elif op == _FILL:
                nbytes = self.cache.fill(body.tier, body.dst, body.seed)
            else:
                digests = self.cache.checksum(body.tier, body.src)
        except (P.ProtocolError, TaskInvalid, CacheError) as err:
            outcome, reason = _FAILED, str(err)  # a ProtocolError reads "code: reason", the §9 code first
        except Exception as err:  # a copy that blew up must still end the task
            log.exception("task %s failed", ex.task)
            outcome, reason = _FAILED, f"{type(err).__name__}: {err}"
        held = not durable and op == _SPILL and outcome is _OK
        return Ran(ex, start, outcome, reason, nbytes, digests, op, held)

    def finish(self, ran: Ran, senders: ResultSenders) -> Finished:
        """Send a task's result to the client, book it, and return what the core books."""
        ex, outcome, nbytes = ran.ex, ran.outcome, ran.nbytes
        reason = ran.reason[:1000]  # a result must stay within the peer's string bound (P.MAX_STR)
        elapsed = time.perf_counter() - ran.start  # a held spill's includes its commit
        if outcome is _OK:
            self.book.task_done(ran.op, elapsed, nbytes)
        self.stats["bytes_moved"] += nbytes
        senders.send(
            ex.reply_to,
            ex.reply_key,
            Result(
                task=ex.task,
                rank=self.rank,
                world=self.world,
                outcome=outcome,
                reason=reason,
                gen=ex.gen,
                bytes=nbytes,
                elapsed_us=int(elapsed * 1e6),
                digests=ran.digests,
                cpu_gen=ex.cpu_gen,
            ).to_wire(),
        )
        if self.on_done is not None:
            try:
                self.on_done(ex.task, outcome)
            except Exception:  # noqa: BLE001 - the engine's hook must not end the rank's thread
                log.exception("on_task_done hook failed for task %s", ex.task)
        return Finished(ex.seq, ex.n, outcome, nbytes, ex.gen)
