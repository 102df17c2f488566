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
from .actions import AllocateCache, FreeCache
from .cache.store import BlockStore
from .reports import CacheDone, Finished, Report
from .result_links import ResultSenders
from .runner import TaskRunner

log = logging.getLogger("zkv.worker")
# What a cache free or allocation raises when the memory is not there (out of
# memory, a manifest gone or refused, a layout the cache cannot hold): the
# rank's ack says why; anything else is a bug and keeps its traceback.
_EXPECTED_CACHE_ERRORS = (ZkvError, MemoryError, RuntimeError, OSError, ValueError)


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
            while True:
                item = self.work.get()
                if item is None:
                    return
                try:
                    reply = self._do(item, senders)
                except Exception as err:  # noqa: BLE001 - this thread must never die: a dead executor looks alive
                    if isinstance(item, (FreeCache, AllocateCache)) and isinstance(err, _EXPECTED_CACHE_ERRORS):
                        # the ack carries it to the broker, which retries backed off: one line, no traceback
                        log.warning("%s failed: %s: %s", type(item).__name__, type(err).__name__, err)
                    else:
                        log.exception("executor: %s failed", type(item).__name__)
                    self.stats["executor_errors"] += 1
                    reply = self._failure(item, f"{type(err).__name__}: {err}")
                self.reports.append(reply)
                report.send(b"")
        finally:
            report.close(linger=0)
            senders.close()

    def _do(self, item: Any, senders: ResultSenders) -> Report:
        if isinstance(item, FreeCache):
            freed = self.cache.free(item.keep_cpu)
            self.stats["bytes_freed"] += freed.nbytes
            return CacheDone(freed.nbytes)
        if isinstance(item, AllocateCache):
            self.cache.allocate(item.layout)
            return CacheDone(0, self.cache.cpu_kept)
        return self.runner.run(item, senders)

    def _failure(self, item: Any, reason: str) -> Report:
        """The report for work that raised, so the I/O thread's books stay right."""
        if isinstance(item, (FreeCache, AllocateCache)):
            return CacheDone(0, None, reason)
        return Finished(item.seq, item.n, RankOutcome.FAILED, 0, item.gen)
