"""A rank's copy executor: the thread that runs queued tasks and cache
operations in order, so a long copy or an allocation never stalls the rank's
I/O loop (``worker.RankWorker`` owns it; docs/architecture.md, "Threads in a
rank").  A rank with a keyed store runs a second one, its *store lane*, for
``put`` and ``get`` alone: a store that answers slowly delays no copy.  The
lanes report on one queue, each report tagged with its lane."""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Any

import zmq

from ..net.curve import Curve
from ..obs.book import RankBook
from ..wire.errors import ZkvError
from ..wire.vocab import Op, RankOutcome
from .actions import Execute, FreeCache
from .reports import CacheDone, Finished, Report
from .result_links import ResultSenders
from .runner import Ran, TaskRunner
from .store import BlockStore

log = logging.getLogger("zkv.worker")
# What a cache free or allocation raises when the memory is not there (out of
# memory, a manifest gone or refused, a layout the cache cannot hold): the
# rank's ack says why; anything else is a bug and keeps its traceback.
_EXPECTED_CACHE_ERRORS = (ZkvError, MemoryError, RuntimeError, OSError, ValueError)
_SPILL, _LOAD = Op.SPILL, Op.LOAD
# Disk tasks queued back to back run as one pass up to these bounds: past a few MiB a
# task's own I/O dwarfs what the pass saves (a header page and a flush, ~0.1-0.2 ms),
# and the first task's result waits for the whole group.
COPY_LANE, STORE_LANE = "copy", "store"
GROUP_BYTES = 4 << 20
GROUP_TASKS = 32
_NOTHING = object()  # no work taken from the queue beyond a group (None is the stop)


class Executor(threading.Thread):
    """Runs queued tasks and cache operations in order, on a thread of its own,
    so a long copy or an allocation never stalls the rank's I/O loop.

    Each piece of work ends in one report (``reports.Finished`` or
    ``CacheDone``) on ``reports``, then one empty frame on the inproc PUSH
    that wakes the I/O thread: a frame read is a report there to take."""

    def __init__(
        self,
        ctx: zmq.Context,
        report_address: str,
        cache: BlockStore,
        rank: int,
        world: int,
        curve: Curve | None = None,
        *,
        lane: str = COPY_LANE,
        reports: collections.deque[tuple[str, Report]] | None = None,
        book: RankBook | None = None,
    ):
        super().__init__(name=f"zkv-{lane}-{rank}", daemon=True)
        self.ctx = ctx
        self.report_address = report_address
        self.cache = cache
        self.curve = curve
        self.lane = lane
        self.work: queue.Queue = queue.Queue()
        # (lane, report): appended here, taken by the I/O thread; shared by a rank's lanes
        self.reports: collections.deque[tuple[str, Report]] = reports if reports is not None else collections.deque()
        # Keys fixed up front: the I/O thread copies this dict while we update values.
        self.stats: collections.Counter[str] = collections.Counter(
            dict.fromkeys(
                (
                    "bytes_moved",
                    "bytes_freed",
                    "undeliverable",
                    "result_reconnects",
                    "copies_after_ack",
                    "dropped_stale_session",
                    "executor_errors",
                    "tasks_inline",
                    "disk_groups",
                ),
                0,
            )
        )
        self.paused_ack = threading.Event()  # set while a pause ack stands (instrumentation)
        self.session = 0  # the rank's registration session, written by the I/O thread
        self.book = book or RankBook()  # copy times and bytes per op, sent in the stats (zkv.obs); lanes share it
        self.runner = TaskRunner(cache, rank, world, self.stats, self.book, self.paused_ack, lambda: self.session)

    def run(self) -> None:
        report = self.ctx.socket(zmq.PUSH)
        report.setsockopt(zmq.LINGER, 0)
        report.connect(self.report_address)
        senders = ResultSenders(self.ctx, self.curve, self.stats)
        try:
            item = self.work.get()
            while item is not None:
                after: Any = _NOTHING  # work taken from the queue while a group was gathered, done next
                if type(item) is Execute:
                    replies, after = self._tasks(item, senders)
                else:
                    replies = [self._do(item)]
                for reply in replies:
                    self.reports.append((self.lane, reply))
                    report.send(b"")
                item = self.work.get() if after is _NOTHING else after  # None, the stop, included
        finally:
            report.close(linger=0)
            senders.close()

    def _tasks(self, first: Execute, senders: ResultSenders) -> tuple[list[Report], Any]:
        """Run ``first``; if it is a spill or a load, run with it the tasks of the same op
        queued behind it (up to ``GROUP_BYTES`` or ``GROUP_TASKS``, no destination twice)
        in one pass: one write and one ``fdatasync`` for spills, one read for loads
        (``BlockStore.move_group``: a 1-block spill's header page and flush cost as much
        as its row, and rows back to back become one I/O).  Then report each, in order.
        Returns the reports and the queued item that ended the group, to be run on its
        own next (work of another kind, the stop, a task at another CPU generation), or
        ``_NOTHING``."""
        runner, cache = self.runner, self.cache
        ran = runner.check(first)
        op = ran.op if ran.body is not None else None
        if op != _SPILL and op != _LOAD:
            return [self._finish(runner.execute(ran), senders)], _NOTHING
        order, group, after, tail = [ran], [ran], _NOTHING, None
        seen = set(ran.body.dst)  # type: ignore[union-attr]
        rows, limit = len(seen), max(1, GROUP_BYTES // max(1, cache.layout.block_bytes))
        while rows < limit and len(order) < GROUP_TASKS:
            try:
                after = self.work.get_nowait()
            except queue.Empty:
                after = _NOTHING
                break
            if type(after) is not Execute or (after.cpu_gen is not None and after.cpu_gen != cache.cpu_gen):
                break  # not a task, or one that moves the CPU generation: run after the group
            nxt, after = runner.check(after), _NOTHING
            order.append(nxt)
            if nxt.body is None:
                continue  # failed its checks: over, reported in its place
            if nxt.op != op or not seen.isdisjoint(nxt.body.dst):
                tail = nxt  # checked, not groupable: run right after the group
                break
            seen.update(nxt.body.dst)
            rows += len(nxt.body.dst)
            group.append(nxt)
        if len(group) > 1:
            runner.execute_group(group)
            self.stats["disk_groups"] += 1
        else:
            runner.execute(ran)
        if tail is not None:
            runner.execute(tail)
        return [self._finish(r, senders) for r in order], after

    def _finish(self, ran: Ran, senders: ResultSenders) -> Report:
        """``TaskRunner.finish``, and a failed task's report should it raise: every task
        taken must be reported, or the rank's inflight count never reaches zero."""
        try:
            return self.runner.finish(ran, senders)
        except Exception:  # noqa: BLE001 - this thread must never die: a dead executor looks alive
            log.exception("executor: reporting task %s failed", ran.ex.task)
            self.stats["executor_errors"] += 1
            return Finished(ran.ex.seq, ran.ex.n, RankOutcome.FAILED, 0, ran.ex.gen)

    def _do(self, item: Any) -> Report:
        """A cache free or allocation; a failure is its report (never raised)."""
        try:
            return self._cache_op(item)
        except Exception as err:  # noqa: BLE001 - this thread must never die: a dead executor looks alive
            if isinstance(err, _EXPECTED_CACHE_ERRORS):
                # the ack carries it to the broker, which retries backed off: one line, no traceback
                log.warning("%s failed: %s: %s", type(item).__name__, type(err).__name__, err)
            else:
                log.exception("executor: %s failed", type(item).__name__)
            self.stats["executor_errors"] += 1
            return CacheDone(0, None, f"{type(err).__name__}: {err}")

    def _cache_op(self, item: Any) -> Report:
        if isinstance(item, FreeCache):
            freed = self.cache.free(item.keep_cpu)
            self.stats["bytes_freed"] += freed.nbytes
            return CacheDone(freed.nbytes)
        self.cache.allocate(item.layout)
        return CacheDone(0, self.cache.cpu_kept)
