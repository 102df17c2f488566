"""A rank worker that books its copy times and per-tier cache bytes in the
stats it already sends with every heartbeat and ack (the broker exports
them: one scrape target, ranks open no port).  See ``zkv.harness.metered``."""

from __future__ import annotations

import time
from typing import Any

from ..obs.book import RankBook, task_op
from ..rank.worker import Executor, RankWorker


class MeteredExecutor(Executor):
    """Times every successful task (validation + copy + the NOBLOCK result
    push) and books its bytes by op."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.book = RankBook()

    def _task(self, ex: Any) -> dict:
        start = time.perf_counter()
        report = super()._task(ex)
        if report["outcome"] == "ok":
            self.book.task_done(task_op(ex.body), time.perf_counter() - start, report["bytes"])
        return report


class MeteredRankWorker(RankWorker):
    executor: MeteredExecutor

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        old = self.executor  # not started yet: serve() starts it
        self.executor = MeteredExecutor(old.ctx, old.report_address, old.cache, old.rank, old.world, old.curve)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s.update(self.executor.book.to_stats())
        tiers = self.cache.tier_nbytes()
        s.update(cache_bytes_gpu=tiers["gpu"], cache_bytes_cpu=tiers["cpu"])
        return s
