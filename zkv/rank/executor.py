"""A rank's copy executor: the thread that runs queued tasks and cache
operations in order, so a long copy or an allocation never stalls the rank's
I/O loop (``worker.RankWorker`` owns it; docs/architecture.md, "Threads in a
rank")."""

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
from ..wire.vocab import RankOutcome
from .actions import Execute, FreeCache
from .cache.errors import CacheError
from .cache.store import BlockStore
from .reports import CacheDone, Finished, Report
from .result_links import ResultSenders
from .runner import Ran, TaskRunner

log = logging.getLogger("zkv.worker")
# What a cache free or allocation raises when the memory is not there (out of
# memory, a manifest gone or refused, a layout the cache cannot hold): the
# rank's ack says why; anything else is a bug and keeps its traceback.
_EXPECTED_CACHE_ERRORS = (ZkvError, MemoryError, RuntimeError, OSError, ValueError)
# Spills queued back to back share one disk commit up to these bounds: past a few MiB the
# rows' own writes dwarf the commit (~0.1-0.2 ms), and the first spill's result waits for
# the whole group.
GROUP_BYTES = 4 << 20
GROUP_TASKS = 32


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
    ):
        super().__init__(name=f"zkv-exec-{rank}", daemon=True)
        self.ctx = ctx
        self.report_address = report_address
        self.cache = cache
        self.curve = curve
        self.work: queue.Queue = queue.Queue()
        self.reports: collections.deque[Report] = collections.deque()  # appended here, taken by the I/O thread
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
                    "spill_groups",
                ),
                0,
            )
        )
        self.paused_ack = threading.Event()  # set while a pause ack stands (instrumentation)
        self.session = 0  # the rank's registration session, written by the I/O thread
        self.book = RankBook()  # copy times and bytes per op, sent in the stats (zkv.obs)
        self.runner = TaskRunner(cache, rank, world, self.stats, self.book, self.paused_ack, lambda: self.session)

    def run(self) -> None:
        report = self.ctx.socket(zmq.PUSH)
        report.setsockopt(zmq.LINGER, 0)
        report.connect(self.report_address)
        senders = ResultSenders(self.ctx, self.curve, self.stats)
        try:
            item = self.work.get()
            while item is not None:
                after = None  # work taken from the queue while spills were gathered, done next
                if type(item) is Execute:
                    replies, after = self._tasks(item, senders)
                else:
                    replies = [self._do(item)]
                for reply in replies:
                    self.reports.append(reply)
                    report.send(b"")
                item = self.work.get() if after is None else after
        finally:
            report.close(linger=0)
            senders.close()

    def _tasks(self, first: Execute, senders: ResultSenders) -> tuple[list[Report], Any]:
        """Run ``first`` and, while it and those after it are spills, the tasks queued behind
        it (up to ``GROUP_BYTES`` spilled or ``GROUP_TASKS`` tasks), with one commit of their
        disk blocks for all (``DiskTier.commit``: a 1-block spill's header page and flush cost
        as much as its row); then report each, in order.  Returns the reports and the
        queued item that ended the group, if one did (not a task: done next)."""
        runner = self.runner
        group = [runner.start(first, durable=False)]
        spilled, after = group[0].nbytes, None
        while group[-1].held and spilled < GROUP_BYTES and len(group) < GROUP_TASKS:
            try:
                after = self.work.get_nowait()
            except queue.Empty:
                break
            if type(after) is not Execute:
                break
            group.append(runner.start(after, durable=False))
            spilled, after = spilled + group[-1].nbytes, None
        if self.cache.uncommitted:
            try:
                self.cache.commit()
            except Exception as err:  # noqa: BLE001 - every held spill fails with it; the thread serves on
                if not isinstance(err, CacheError):
                    log.exception("executor: a disk commit failed")
                for ran in group:
                    if ran.held:
                        ran.fail(str(err) if isinstance(err, CacheError) else f"{type(err).__name__}: {err}")
        if len(group) > 1:
            self.stats["spill_groups"] += 1
        return [self._finish(ran, senders) for ran in group], after

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
