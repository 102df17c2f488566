"""vLLM's ``OffloadingWorker`` on zkv: each vLLM worker process hosts one zkv
rank on that worker's own KV tensors, and vLLM's store and load jobs run as
zkv tasks (docs/engine-vllm.md).

A job may move blocks of several KV cache groups (``groups.py``): its GPU
block ids come group by group, in the order of its keys and so of its CPU
rows, and each block moves as one row (the block's page of every canonical
tensor, whichever group holds it).

The rank (a ``RankAgent`` on vLLM's canonical block tensors, one region each,
vLLM's null block reserved) registers with the engine's bus whenever it
comes up.  The worker of TP rank 0 submits each job as one task to every
rank (``swap_out`` GPU blocks -> CPU rows for a store, ``swap_in`` for a
load), under a task id every worker derives from vLLM's job id; each worker
reports a job finished when its own rank's copy is over (``jobs.py``).  A job
whose task did not end ``ok`` is reported failed, through vLLM's own
failure channel where it has one (``api.NATIVE_FAILURES``): a failed load is
recomputed, a failed store never indexed, instead of vLLM's stock assert.
Its CPU rows travel to the scheduler too (``take_failures``), so that the
manager forgets the keys they hold.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, LoadStoreSpec, OffloadingWorker, TransferResult

from ...client.client import Client
from ...rank.agent import RankAgent
from ...rank.memory.regions import EngineCache
from ...rank.tiers.tier_file import bus_name, clean_tiers
from ...wire.errors import ZkvError
from ...wire.outcome import TaskOutcome
from ...wire.vocab import Op, Outcome
from .api import NATIVE_FAILURES, gpu_block_ids
from .groups import name
from .jobs import Finished, Job, JobBook
from .layouts import canonical_pages
from .rows import ZkvRows
from .settings import ZkvSettings

log = logging.getLogger("zkv.vllm")
_REQUESTS_KEPT = 4096


class ZkvOffloadWorker(OffloadingWorker):
    """One vLLM worker's zkv rank, and (rank 0) the client that runs the jobs."""

    def __init__(
        self,
        settings: ZkvSettings,
        rank: int,
        world: int,
        kv_caches: CanonicalKVCaches,
        groups: list[dict[str, Any]] | None = None,
    ):
        """``groups``: the KV cache groups vLLM offloads (``groups.describe``), for the log."""
        self.settings = settings
        self.rank, self.world = rank, world
        self.kv_caches = kv_caches
        entries = canonical_pages(kv_caches.tensors)  # vLLM's null block reserved
        self.block_bytes = sum(t.page_size_bytes for t in kv_caches.tensors)
        generations = itertools.count(2)
        ep = settings.endpoints
        # A task still queued on this rank past its deadline may yet run: a job is given up on
        # only after as long again, so that vLLM never recomputes into blocks a late copy writes.
        self.book = JobBook(submitter=rank == 0, grace=max(1.0, settings.task_timeout_s))
        self._jobs = threading.Condition()  # the book is touched by vLLM's thread and the rank's
        self.agent = RankAgent(
            rank,
            world,
            ep.backend,
            ep.control,
            entries,
            settings.cpu_blocks,
            disk_dir=settings.disk_dir,
            disk_blocks=settings.disk_blocks,
            tier_dir=settings.tier_dir,
            # vLLM keeps its KV tensors where they are across a zkv clear: each
            # resume serves the same tensors again, as a new generation.
            source=lambda: EngineCache.from_tensors(entries, generation=next(generations)),
            on_task_done=self._ran,
            store=settings.store,
        )
        self.agent.start(wait=False)  # the engine's broker may come up after its workers
        log.warning("zkv: %s", settings.reserved(rank, self.block_bytes))
        if rank == 0 and groups is not None and len(groups) > 1:
            used = [sum(r.page_size_bytes for r in refs) for refs in kv_caches.group_data_refs]
            log.warning(
                "zkv: %d KV cache groups, one row of %d bytes per block: %s",
                len(groups),
                self.block_bytes,
                "; ".join(f"{name(g)} {n} bytes of it" for g, n in zip(groups, used)),
            )
        self.client = Client(ep.frontend, request_timeout=0.25) if rank == 0 else None  # bounds a send to no broker
        self._failed_loads: set[int] = set()  # GPU block ids of failed loads, for vLLM to recompute (0.32)
        self._failed_jobs: dict[int, tuple[bool, list[int]]] = {}  # job id -> (is_store, CPU rows), not yet taken
        self._requests: dict[int, str] = {}  # load job id -> vLLM request id (0.32: whole-request recomputes)
        self._failed_requests: set[str] = set()  # requests of failed loads, not yet taken (0.32)
        self._cancel_asked: set[int] = set()  # tasks whose cancel was sent while the bus was paused
        self._paused_for_sleep = False  # this worker paused the bus while vLLM's KV memory is away

    # --- jobs --------------------------------------------------------------------------

    def _ran(self, task: int, outcome: str) -> None:
        """This rank's copy of ``task`` is over (called on the rank's thread)."""
        with self._jobs:
            self.book.on_local(task, outcome)
            self._jobs.notify_all()

    def _outcome(self, out: TaskOutcome) -> None:
        with self._jobs:
            self.book.on_outcome(out)
            self._jobs.notify_all()

    def _submit(self, job_id: int, op: Op, src: list[int], dst: list[int], gpu_ids: list[int]) -> bool:
        now = time.monotonic()
        timeout = self.settings.task_timeout_s
        task = JobBook.task_of(job_id)
        store = op is Op.SWAP_OUT
        job = Job(
            job_id=job_id,
            task=task,
            is_store=store,
            gpu_ids=gpu_ids,
            cpu_rows=dst if store else src,
            nbytes=len(gpu_ids) * self.block_bytes,
            started=now,
            deadline=now + timeout,
        )
        with self._jobs:
            self.book.add(job)
        if self.client is not None:
            try:
                self.client.submit(op, src, dst, timeout=timeout, task=task)
            except ZkvError as err:  # the bus is unreachable: the job fails, vLLM recomputes
                self._outcome(TaskOutcome(task, Outcome.FAILED, f"not submitted: {err}", never_ran=True))
        return True

    # The GPU side is a GPULoadStoreSpec (vLLM 0.32) or DevicePointers (0.34): api.gpu_block_ids.
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, ZkvRows)
        gpu = gpu_block_ids(src_spec, self.kv_caches)
        return self._submit(job_id, Op.SWAP_OUT, gpu, dst_spec.rows, gpu)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False) -> bool:
        """``expedited`` (0.34) loads never come: the connector turns vLLM's sync loads off."""
        assert isinstance(src_spec, ZkvRows)
        gpu = gpu_block_ids(dst_spec, self.kv_caches)
        return self._submit(job_id, Op.SWAP_IN, src_spec.rows, gpu, gpu)

    def _pump(self, timeout: float = 0.0) -> None:
        if self.client is not None:
            self._cancel_while_paused()
            for out in self.client.poll(timeout):
                self._outcome(out)

    def _cancel_while_paused(self) -> None:
        """No job waits on a paused bus: the submitter cancels its tasks still
        queued at the broker (a dispatched one runs to its own outcome), so
        they end ``cancelled`` now, and vLLM recomputes, instead of at their deadline."""
        assert self.client is not None
        if not self.agent.paused:
            self._cancel_asked.clear()
            return
        with self._jobs:
            waiting = [j for j in self.book.jobs.values() if j.outcome is None and j.local is None]
        for job in waiting:
            if job.task not in self._cancel_asked:
                self._cancel_asked.add(job.task)
                try:
                    self.client.cancel(job.task, timeout=0.25)
                except ZkvError as err:
                    log.info("zkv: cancel of job %d not answered: %s", job.job_id, err)

    def requests_of_loads(self, loads: dict[int, str]) -> None:
        """vLLM's load jobs of this step and their requests (from the connector's metadata), so
        that a failed load names its request (0.32: ``take_failed_requests``)."""
        self._requests.update(loads)
        while len(self._requests) > _REQUESTS_KEPT:  # jobs never submitted: the oldest go
            del self._requests[next(iter(self._requests))]

    def _result(self, done: Finished) -> TransferResult:
        job = done.job
        request = self._requests.pop(job.job_id, None)
        if not done.success:
            self._failed_jobs[job.job_id] = (job.is_store, job.cpu_rows)
            if not job.is_store and not NATIVE_FAILURES:
                self._failed_loads.update(job.gpu_ids)
                if request is not None:
                    self._failed_requests.add(request)
            log.info("zkv: %s job %d failed (%s)", "store" if job.is_store else "load", job.job_id, done.reason)
        # Without vLLM's own failure channel (0.32) a failure is reported done, and ZkvConnector
        # hands its GPU blocks to vLLM itself (get_block_ids_with_load_errors).
        success = done.success or not NATIVE_FAILURES
        return TransferResult(job.job_id, success, job.nbytes, time.monotonic() - job.started)

    def get_finished(self) -> list[TransferResult]:
        self._pump()
        wait = self.settings.load_wait_s
        if wait > 0:
            # A request waiting on a load cannot run before the next engine step
            # sees the load finished: waiting here a little (the copy is usually
            # milliseconds) saves the steps in between.
            with self._jobs:
                loads = [j.job_id for j in self.book.jobs.values() if not j.is_store]
            if loads:
                self._wait(loads, time.monotonic() + wait)
        with self._jobs:
            finished = self.book.take_finished(time.monotonic())
        return [self._result(done) for done in finished]

    def wait(self, job_ids: set[int]) -> None:
        """Block until every job in ``job_ids`` is finished for this worker
        (bounded by each task's deadline); they are still reported by get_finished."""
        self._wait(job_ids, float("inf"))

    def _wait(self, job_ids: Iterable[int], bound: float) -> None:
        """Until each job is finished for this worker, or ``bound``: the submitter pumps its
        client for the outcome; a worker waits for its rank's thread to say its copy is over."""
        for job_id in job_ids:
            task = JobBook.task_of(job_id)
            with self._jobs:
                job = self.book.jobs.get(task)
                if job is None:
                    continue
                until = min(bound, self.book.wakes_at(task))
            while True:
                with self._jobs:
                    now = time.monotonic()
                    if self.book.is_finished(task, now) or now >= until:
                        break
                    pump = self.client is not None and job.outcome is None and self.client.open_tasks
                    if not pump:
                        self._jobs.wait(until - now)
                        continue
                self._pump(max(0.0, until - time.monotonic()))

    # --- KV memory that goes away (vLLM 0.34: sleep, a weight update's loan) -----------------

    def kv_memory_gone(self) -> None:
        """vLLM is about to unmap the KV memory: no copy may touch it until it is back.
        The worker of rank 0 pauses the bus (acked once no copy is in flight on any rank,
        and nothing is dispatched while paused); a bus someone else paused stays theirs."""
        if self.client is None or self._paused_for_sleep:
            return
        try:
            reply = self.client.pause(timeout=max(1.0, self.settings.task_timeout_s))
        except ZkvError as err:  # no broker answers: nothing is dispatched either
            log.warning("zkv: bus not paused before vLLM releases its KV memory: %s", err)
            return
        self._paused_for_sleep = not reply.noop

    def kv_memory_back(self) -> None:
        """The KV memory is mapped again: clear the bus this worker paused for it, without
        keeping its CPU tier, then resume it.  While the memory was away the weights may
        have changed (a weight update is what a sleep is for) and nobody measured them, so
        the engine's manager forgets every row (vLLM's ``sleep(reset_connector=False)``
        keeps zkv's tiers only when a cycle that measures the weights kept them: such a
        cycle paused the bus itself, and a bus someone else paused stays theirs)."""
        if self.client is None or not self._paused_for_sleep:
            return
        timeout = max(1.0, self.settings.task_timeout_s)
        try:
            self.client.clear(keep_cpu=False, timeout=timeout)
        except ZkvError as err:
            log.warning("zkv: bus not cleared after vLLM restored its KV memory: %s (left paused)", err)
            return
        try:
            self.client.resume(timeout=timeout)
            self._paused_for_sleep = False
        except ZkvError as err:
            log.warning("zkv: bus not resumed after vLLM restored its KV memory: %s (zkv resume)", err)

    def take_failures(self) -> tuple[dict[int, tuple[bool, list[int]]], set[int]]:
        """(failed job id -> (is_store, its CPU rows), GPU block ids of failed loads for
        vLLM to recompute: 0.32 only) since the last call."""
        jobs, blocks = self._failed_jobs, self._failed_loads
        self._failed_jobs, self._failed_loads = {}, set()
        return jobs, blocks

    def take_failed_requests(self) -> set[str]:
        """The vLLM requests whose load failed since the last call (0.32)."""
        taken, self._failed_requests = self._failed_requests, set()
        return taken

    def stats(self) -> dict:
        return self.agent.stats()

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.close()
        self.agent.stop(timeout=10.0)
        if not self.settings.bus_named and self.settings.tier_dir:
            # A bus named by this start only: no engine will ever serve its CPU tier file again.
            clean_tiers(self.settings.tier_dir, bus_name(self.settings.endpoints.backend))
