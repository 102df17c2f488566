"""Spills queued back to back share one disk commit (``rank/executor.py``): a real
executor thread on a real store with a disk tier, its reports on an inproc socket
and its results on an ipc one, with the work queued before the thread starts so
the groups it forms are known.  Every task still gets its own result, in order;
a group ends at a task that is not a held spill; the blocks of every spill
reported ok are on the file when the store is opened again."""

import pytest
import zmq

from zkv.rank import executor as executor_module
from zkv.rank.actions import Execute, FreeCache
from zkv.rank.cache.disk_tier import DiskSpec
from zkv.rank.cache.errors import CacheError
from zkv.rank.cache.store import BlockStore
from zkv.rank.executor import Executor
from zkv.rank.reports import CacheDone, Finished
from zkv.wire import fast as F
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout
from zkv.wire.vocab import RankOutcome

LAYOUT = CacheLayout(layers=1, gpu_blocks=8, cpu_blocks=16, block_size=4, kv_heads=2, head_dim=16)
_result = F.decoder("result")


class Rig:
    """An executor over ``store``, its report and result sockets bound."""

    def __init__(self, store: BlockStore, tmp_path):
        self.ctx = zmq.Context()
        self.results_address = f"ipc://{tmp_path}/results.sock"
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(self.results_address)
        report_address = "inproc://spill-group-reports"
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.setsockopt(zmq.LINGER, 0)
        self.reports.bind(report_address)
        self.executor = Executor(self.ctx, report_address, store, rank=0, world=1)
        self.seq = 0

    def task(self, op: str, src, dst, **extra) -> Execute:
        self.seq += 1
        body = P.encode_body(op, src, dst, **extra)
        return Execute(seq=self.seq, n=1, task=100 + self.seq, reply_to=self.results_address, gen=1, body=body)

    def run(self, work: list) -> tuple[list, dict[int, object]]:
        """Queue ``work``, start the thread, and collect one report per item and the results."""
        for item in work:
            self.executor.work.put(item)
        self.executor.start()
        reports = []
        for _ in work:
            assert self.reports.poll(10_000), "every item taken is reported"
            self.reports.recv()
            reports.append(self.executor.reports.popleft())
        tasks = sum(type(item) is Execute for item in work)
        results = {}
        while len(results) < tasks:
            assert self.results.poll(10_000), f"results: {len(results)} of {tasks}"
            msg = _result(self.results.recv())
            results[msg.task] = msg
        return reports, results

    def close(self) -> None:
        self.executor.work.put(None)
        self.executor.join(timeout=10)
        assert not self.executor.is_alive()
        self.results.close(linger=0)
        self.reports.close(linger=0)
        self.ctx.term()


@pytest.fixture
def store(tmp_path):
    disk = DiskSpec(str(tmp_path / "disk"), 32)
    s = BlockStore.owned(LAYOUT, disk=disk)
    s.fill("cpu", list(range(8)), seed=3)
    yield s
    s.close()


def test_spills_queued_back_to_back_share_one_commit_and_each_gets_its_own_result(store, tmp_path):
    rig = Rig(store, tmp_path)
    want = store.checksum("cpu", list(range(6)))
    work = [
        rig.task("spill", [0], [10]),
        rig.task("spill", [1, 2], [11, 12]),
        rig.task("spill", [3], [99]),  # out of range: fails alone and ends the first group
        rig.task("spill", [3], [13]),
        rig.task("spill", [4, 5], [14, 15]),
        rig.task("load", [10], [9]),  # reads a block of its own group before the commit: ends it
        FreeCache(keep_cpu=True),  # not a task: taken after the group, done after it
    ]
    try:
        reports, results = rig.run(work)
    finally:
        rig.close()
    finished = [r for r in reports if isinstance(r, Finished)]
    assert [r.seq for r in finished] == [1, 2, 3, 4, 5, 6], "reported in queue order"
    assert isinstance(reports[-1], CacheDone) and not reports[-1].error
    outcomes = [results[101 + i].outcome for i in range(6)]
    assert outcomes == [RankOutcome.OK] * 2 + [RankOutcome.FAILED] + [RankOutcome.OK] * 3, outcomes
    assert "99" in results[103].reason
    assert [r.outcome for r in finished] == outcomes
    assert rig.executor.stats["spill_groups"] == 2
    assert store.disk is not None and store.disk.to_stats()["commits"] == 2, "one commit per group"
    spilled = [10, 11, 12, 13, 14, 15]
    assert store.checksum("disk", spilled) == want
    assert store.checksum("cpu", [9]) == want[:1], "the load read the spill before it, exactly"
    store.close()  # the process ends: what was reported ok is on the file
    again = BlockStore.owned(LAYOUT, disk=DiskSpec(str(tmp_path / "disk"), 32))
    try:
        assert again.disk is not None and again.disk.reopened == 6
        assert again.checksum("disk", spilled) == want
    finally:
        again.close()


def test_a_group_stops_at_its_bound_and_a_failed_commit_fails_every_spill_of_it(store, tmp_path, monkeypatch):
    monkeypatch.setattr(executor_module, "GROUP_TASKS", 2)
    rig = Rig(store, tmp_path)
    disk = store.disk
    assert disk is not None
    calls = []
    real_commit = disk.commit

    def commit() -> None:
        calls.append(disk.uncommitted)
        if len(calls) == 2:  # the second group's flush fails: the device said EIO
            disk._uncommitted.clear()
            raise CacheError("disk_io", "disk tier write failed: [Errno 5] Input/output error")
        real_commit()

    monkeypatch.setattr(disk, "commit", commit)
    work = [rig.task("spill", [i], [20 + i]) for i in range(5)]
    try:
        reports, results = rig.run(work)
    finally:
        rig.close()
    assert len(calls) == 3, "groups of 2, 2 and 1"
    outcomes = [results[101 + i].outcome for i in range(5)]
    assert outcomes == [RankOutcome.OK, RankOutcome.OK, RankOutcome.FAILED, RankOutcome.FAILED, RankOutcome.OK]
    assert all("disk_io" in results[101 + i].reason for i in (2, 3))
    assert [r.outcome for r in reports] == outcomes and all(r.nbytes == 0 for r in reports[2:4])
