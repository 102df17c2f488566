"""Disk tasks queued back to back run as one pass (``rank/executor.py``,
``BlockStore.move_group``): a real executor thread on a real store with a disk
tier, its reports on an inproc socket and its results on an ipc one, with the
work queued before the thread starts so the groups it forms are known.  Every
task still gets its own result, in order, and its own outcome; a group ends at
work of another kind or a destination named twice; what was reported ok is
exact, on the file when the store opens again, and a failed load leaves its
rows lost."""

import os
import tempfile

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zkv.rank import executor as executor_module
from zkv.rank.actions import Execute, FreeCache
from zkv.rank.errors import CacheError
from zkv.rank.executor import Executor
from zkv.rank.reports import CacheDone, Finished
from zkv.rank.store import BlockStore
from zkv.rank.tiers.disk_tier import DiskSpec
from zkv.wire import fast as F
from zkv.wire import protocol as P
from zkv.wire import sockets as S
from zkv.wire.layout import CacheLayout
from zkv.wire.vocab import RankOutcome

LAYOUT = CacheLayout(layers=1, gpu_blocks=8, cpu_blocks=16, block_size=4, kv_heads=2, head_dim=16)
OK, FAILED = RankOutcome.OK, RankOutcome.FAILED
_result = F.decoder(S.CLIENT_PULL)


class Rig:
    """An executor over ``store``, its report and result sockets bound."""

    def __init__(self, store: BlockStore, tmp_path):
        self.ctx = zmq.Context()
        self.results_address = f"ipc://{tmp_path}/results.sock"
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(self.results_address)
        report_address = "inproc://disk-group-reports"
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.setsockopt(zmq.LINGER, 0)
        self.reports.bind(report_address)
        self.executor = Executor(self.ctx, report_address, store, rank=0, world=1)
        self.seq = 0

    def task(self, op: str, src, dst) -> Execute:
        self.seq += 1
        body = P.encode_body(op, src, dst)
        return Execute(seq=self.seq, n=1, task=100 + self.seq, reply_to=self.results_address, gen=1, body=body)

    def run(self, work: list) -> tuple[list, list]:
        """Queue ``work``, start the thread, and collect one report per item and each task's result."""
        for item in work:
            self.executor.work.put(item)
        self.executor.start()
        reports = []
        for _ in work:
            assert self.reports.poll(10_000), "every item taken is reported"
            self.reports.recv()
            reports.append(self.executor.reports.popleft()[1])  # (lane, report)
        tasks = sum(type(item) is Execute for item in work)
        results: dict[int, object] = {}
        while len(results) < tasks:
            assert self.results.poll(10_000), f"results: {len(results)} of {tasks}"
            msg = _result(self.results.recv())
            results[msg.task] = msg
        return reports, [results[t] for t in sorted(results)]

    def close(self) -> None:
        self.executor.work.put(None)
        self.executor.join(timeout=10)
        assert not self.executor.is_alive()
        self.results.close(linger=0)
        self.reports.close(linger=0)
        self.ctx.term()


@pytest.fixture
def store(tmp_path):
    s = BlockStore.owned(LAYOUT, disk=DiskSpec(str(tmp_path / "disk"), 64))
    s.fill("cpu", list(range(8)), seed=3)
    yield s
    s.close()


def counted(monkeypatch, obj, name: str) -> list:
    """Count the calls of ``obj.name`` (the real method still runs)."""
    calls: list = []
    real = getattr(obj, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, spy)
    return calls


def test_spills_queued_back_to_back_are_one_write_and_each_gets_its_own_result(store, tmp_path, monkeypatch):
    writes = counted(monkeypatch, store.disk, "write")
    rig = Rig(store, tmp_path)
    want = store.checksum("cpu", list(range(6)))
    work = [
        rig.task("spill", [0], [10]),
        rig.task("spill", [1, 2], [11, 12]),
        rig.task("spill", [3], [99]),  # out of range: fails its checks alone, the group goes on
        rig.task("spill", [3], [13]),
        rig.task("spill", [4, 5], [14, 15]),
        rig.task("load", [10], [9]),  # another op: runs right after the group, reading its spill
        FreeCache(keep_cpu=True),  # not a task: after the tasks
    ]
    try:
        reports, results = rig.run(work)
    finally:
        rig.close()
    outcomes = [r.outcome for r in results]
    assert outcomes == [OK, OK, FAILED, OK, OK, OK], [r.reason for r in results]
    assert "99" in results[2].reason
    finished = [r for r in reports if isinstance(r, Finished)]
    assert [r.seq for r in finished] == [1, 2, 3, 4, 5, 6] and [r.outcome for r in finished] == outcomes
    assert [r.bytes for r in results] == [n * LAYOUT.block_bytes for n in (1, 2, 0, 1, 2, 1)]
    assert isinstance(reports[-1], CacheDone) and not reports[-1].error
    assert rig.executor.stats["disk_groups"] == 1
    assert len(writes) == 1, "four spills, one write and one fdatasync"
    spilled = [10, 11, 12, 13, 14, 15]
    assert store.checksum("disk", spilled) == want
    assert store.checksum("cpu", [9]) == want[:1], "the load read the spill before it, exactly"
    store.close()  # the process ends: what was reported ok is on the file
    again = BlockStore.owned(LAYOUT, disk=DiskSpec(str(tmp_path / "disk"), 64))
    try:
        assert again.disk is not None and again.disk.reopened == 6
        assert again.checksum("disk", spilled) == want
    finally:
        again.close()


def test_loads_queued_back_to_back_are_one_read_and_a_lost_block_fails_only_its_task(store, tmp_path, monkeypatch):
    want = store.checksum("cpu", list(range(4)))
    store.move("spill", [0, 1, 2, 3], [20, 21, 22, 23])
    disk = store.disk
    assert disk is not None
    with open(disk.path, "r+b") as f:  # tear disk block 22 behind the tier's back
        f.seek(disk.data_off + 22 * disk.slot + 64)
        f.write(b"\xff" * 32)
    reads = counted(monkeypatch, disk, "read_rows")
    rig = Rig(store, tmp_path)
    work = [
        rig.task("load", [20, 21], [8, 9]),
        rig.task("load", [22], [10]),  # torn: fails alone, CPU row 10 is lost
        rig.task("load", [40], [11]),  # never spilled: fails alone, CPU row 11 is lost
        rig.task("load", [23], [12]),
        rig.task("load", [21], [13]),  # a disk block the first task reads too
        rig.task("load", [20], [8]),  # CPU row 8 again: runs after the group
    ]
    try:
        reports, results = rig.run(work)
    finally:
        rig.close()
    assert [r.outcome for r in results] == [OK, FAILED, FAILED, OK, OK, OK], [r.reason for r in results]
    assert "disk_lost" in results[1].reason and "22" in results[1].reason and "digest" in results[1].reason
    assert "disk_lost" in results[2].reason and "40" in results[2].reason and "hold no block" in results[2].reason
    assert [r.outcome for r in reports] == [r.outcome for r in results]
    assert rig.executor.stats["disk_groups"] == 1
    assert len(reads) == 2, "the group's rows in one read, then the load after it"
    assert store.checksum("cpu", [8, 9, 12, 13]) == [want[0], want[1], want[3], want[1]]
    for row in (10, 11):
        with pytest.raises(CacheError, match="lost_block"):
            store.checksum("cpu", [row])


def test_a_group_stops_at_its_bound_and_a_device_error_fails_every_spill_of_its_group(store, tmp_path, monkeypatch):
    monkeypatch.setattr(executor_module, "GROUP_TASKS", 2)
    disk = store.disk
    assert disk is not None
    calls: list = []
    real_write = disk.write

    def write(dst, addresses, span=0):
        calls.append(list(dst))
        if len(calls) == 2:  # the device fails the second group's write
            raise CacheError("disk_io", "disk tier write failed: [Errno 5] Input/output error")
        return real_write(dst, addresses, span)

    monkeypatch.setattr(disk, "write", write)
    rig = Rig(store, tmp_path)
    try:
        reports, results = rig.run([rig.task("spill", [i], [30 + i]) for i in range(5)])
    finally:
        rig.close()
    assert sorted(map(sorted, calls)) == [[30, 31], [32, 33], [34]], "groups of 2, 2 and 1"
    assert [r.outcome for r in results] == [OK, OK, FAILED, FAILED, OK]
    assert all("disk_io" in results[i].reason for i in (2, 3))
    assert [r.outcome for r in reports] == [r.outcome for r in results]
    assert all(r.nbytes == 0 for r in reports[2:4])


def test_the_stop_queued_behind_a_group_still_stops_the_executor(store, tmp_path):
    rig = Rig(store, tmp_path)
    work = [rig.task("spill", [0], [40]), rig.task("spill", [1], [41])]
    for item in work:
        rig.executor.work.put(item)
    rig.executor.work.put(None)  # taken while the group is gathered: it must still end the thread
    rig.executor.start()
    rig.executor.join(timeout=10)
    assert not rig.executor.is_alive(), "the stop was lost behind the group"
    assert [r.outcome for _, r in rig.executor.reports] == [OK, OK]
    assert rig.executor.stats["disk_groups"] == 1
    rig.results.close(linger=0)
    rig.reports.close(linger=0)
    rig.ctx.term()


# --- a group is its tasks one by one ---------------------------------------------------------

LONG = os.environ.get("ZKV_LONG_MODEL") == "1"  # the long profile, as tests/test_bus_model.py
ROWS = 12  # CPU and disk rows of the differential stores
_pairs = st.lists(st.tuples(st.integers(0, ROWS - 1), st.integers(0, ROWS - 1)), min_size=1, max_size=3)


@st.composite
def groups(draw) -> tuple[str, list[tuple[list[int], list[int]]]]:
    """An op and 1-5 tasks of it, no destination twice among them (the executor's rule)."""
    op = draw(st.sampled_from(["spill", "load"]))
    tasks, seen = [], set()
    for pairs in draw(st.lists(_pairs, min_size=1, max_size=5)):
        src, dst = [], []
        for s, d in pairs:
            if d not in seen:
                seen.add(d)
                src.append(s)
                dst.append(d)
        if src:
            tasks.append((src, dst))
    return op, tasks


def _ends(store: BlockStore, ends: list) -> list[tuple]:
    """What each task ended as: its bytes, or its error's code and rows."""
    return [(end,) if isinstance(end, int) else (end.code, tuple(getattr(end, "rows", ()))) for end in ends]


def _content(store: BlockStore) -> list:
    """Every CPU row's and disk row's digest, or 'lost'."""
    out = []
    for tier in ("cpu", "disk"):
        for row in range(ROWS):
            try:
                out.append(store.checksum(tier, [row])[0])
            except CacheError as err:
                out.append(err.code)
    return out


@settings(max_examples=200 if LONG else 25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=st.lists(groups(), max_size=3), torn=st.sets(st.integers(0, ROWS - 1), max_size=2), group=groups())
def test_a_group_of_disk_tasks_ends_as_its_tasks_run_one_by_one(setup, torn, group):
    layout = CacheLayout(layers=1, gpu_blocks=4, cpu_blocks=ROWS, block_size=4, kv_heads=2, head_dim=16)
    with tempfile.TemporaryDirectory(prefix="zkv-groups-", dir="/var/tmp") as root:
        stores = [BlockStore.owned(layout, disk=DiskSpec(f"{root}/{name}", ROWS)) for name in ("one", "group")]
        try:
            for store in stores:
                store.fill("cpu", list(range(ROWS)), seed=9)
                for op, tasks in setup:  # the same history on both, a task at a time
                    for src, dst in tasks:
                        try:
                            store.move(op, src, dst)
                        except CacheError:
                            pass
                disk = store.disk
                assert disk is not None
                for row in torn:  # the same disk rows torn behind both tiers' backs
                    with open(disk.path, "r+b") as f:
                        f.seek(disk.data_off + row * disk.slot + 8)
                        f.write(b"\xa5" * 16)
            assert _content(stores[0]) == _content(stores[1])
            op, tasks = group
            one: list = []
            for src, dst in tasks:
                try:
                    one.append(stores[0].move(op, src, dst))
                except CacheError as err:
                    one.append(err)
            grouped = stores[1].move_group(op, tasks)
            assert _ends(stores[0], one) == _ends(stores[1], grouped)
            assert _content(stores[0]) == _content(stores[1])
        finally:
            for store in stores:
                store.close()
