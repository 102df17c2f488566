"""The keyed store below the CPU tier (zkv/rank/tiers/store_tier.py): a host tier
(a directory every engine on a host shares) and a Redis tier, reached by ``put``
and ``get`` tasks on real buses (a broker and two ranks on threads, ipc
sockets, real tensors).  What one bus puts, another bus of the same namespace
gets bit for bit; another namespace gets nothing; a store that is down, slow,
flushed, restarted or holding corrupted bytes fails the task within its bound,
never serves other bytes, and never holds up the rank's copies."""

from __future__ import annotations

import json
import threading
import time

import pytest
from redis_server import RedisServer

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.client.client import Client
from zkv.net.endpoints import Endpoints
from zkv.rank.errors import CacheError
from zkv.rank.tiers.disk_io import RowDigest
from zkv.rank.tiers.store_tier import FileStore, Frame, check_value, digest_for, encode_value, name_of, open_store
from zkv.rank.worker import RankWorker
from zkv.wire.layout import CacheLayout
from zkv.wire.vocab import Outcome

LAYOUT = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=16, block_size=4, kv_heads=2, head_dim=8)
NS = "0123abcd"
KEYS = [bytes([i]) * 20 for i in range(1, 7)]


# --- the framing ------------------------------------------------------------------------


def _row(n: int = 256, fill: int = 7) -> bytearray:
    return bytearray((fill + i) % 251 for i in range(n))


def _frame(key: bytes = b"k", rank: int = 0, ns: str = NS, digest: bytes = b"") -> Frame:
    return Frame(ns, rank, key, b"L" * 16, 256, digest)


def test_a_value_reads_back_only_as_the_block_it_was_written_for():
    row = _row()
    digest = digest_for(len(row))
    from zkv.rank.tiers.store_tier import address_of_view

    stored = digest.of([address_of_view(memoryview(row))])[0]
    value = encode_value(_frame(digest=stored), memoryview(row))
    assert bytes(check_value(value, _frame(), digest)) == bytes(row)
    for other in (_frame(key=b"x"), _frame(rank=1), _frame(ns="ffff")):
        with pytest.raises(CacheError, match="names another block"):
            check_value(value, other, digest)
    torn = bytearray(value)
    torn[-3] ^= 0x10
    with pytest.raises(CacheError, match="does not check"):
        check_value(bytes(torn), _frame(), digest)
    for cut in (value[:3], value[:40], value[:-1]):
        with pytest.raises(CacheError, match="lost_block"):
            check_value(cut, _frame(), digest)
    assert isinstance(digest, RowDigest)


def test_a_file_store_keeps_one_budget_for_every_process_and_evicts_the_least_recently_used(tmp_path):
    a, b = FileStore(tmp_path, budget=4000), FileStore(tmp_path, budget=4000)  # two engines on one host
    names = [name_of(NS, 0, bytes([i])) for i in range(6)]
    a.put(names[:3], [b"a" * 1000] * 3)
    b.put(names[3:4], [b"b" * 1000])
    assert a.get(names[:1]) == [b"a" * 1000]  # the oldest, read again: the most recent now
    b.put(names[4:6], [b"c" * 1000] * 2)  # over the budget: the least recently used go
    assert sum(f.stat().st_size for f in tmp_path.glob("*/*")) <= 4000
    assert a.exists(names) == [True, False, False, True, True, True]


def test_a_file_read_holds_what_it_reads_while_an_eviction_unlinks_it(tmp_path):
    store = FileStore(tmp_path, budget=10_000)
    name = name_of(NS, 0, b"k")
    store.put([name], [b"v" * 100])
    path = store._path(name)
    with open(path, "rb") as reader:  # a get in progress
        path.unlink()  # another engine's eviction
        assert reader.read() == b"v" * 100
    assert store.get([name]) == [None]


def test_a_namespace_is_retired_whole(tmp_path):
    store = FileStore(tmp_path, budget=10_000)
    store.put([name_of("old", 0, b"a"), name_of("old", 1, b"a"), name_of("new", 0, b"a")], [b"x"] * 3)
    assert store.retire("old") == 2
    assert store.exists([name_of("old", 0, b"a"), name_of("new", 0, b"a")]) == [False, True]


@pytest.mark.parametrize(
    "url, why",
    [
        ("file:///tmp/zkv-x", "budget"),
        ("file://host/tmp?budget=1G", "file:///ABSOLUTE"),
        ("s3://bucket", "a store is"),
        ("redis://127.0.0.1:1/0?timeout=0", "timeout"),
    ],
)
def test_a_store_url_it_cannot_use_is_refused_naming_why(url, why):
    with pytest.raises(ValueError, match=why):
        open_store(url)


# --- on real buses ----------------------------------------------------------------------------


class Bus:
    """A broker and two ranks on threads, each rank on ``store``."""

    def __init__(self, directory, store: str):
        self.endpoints = Endpoints.in_dir(directory)
        self.loops = [Broker(self.endpoints, BrokerConfig(world=2, heartbeat_ms=100))]
        self.loops += [
            RankWorker(r, 2, self.endpoints.backend, self.endpoints.control, LAYOUT, device="cpu", store=store)
            for r in range(2)
        ]
        self.threads = [threading.Thread(target=x.serve, daemon=True) for x in self.loops]
        for t in self.threads:
            t.start()
        self.client = Client(self.endpoints.frontend, request_timeout=30)
        self.client.status(timeout=30, wait_ranks=2)

    def run(self, op, src=None, dst=None, timeout=30.0, **extra):
        return self.client.run(op, src, dst, timeout, **extra)

    def digests(self, rows) -> dict:
        out = self.run("checksum", rows, tier="cpu")
        assert out.ok, out
        return {rank: said["digests"] for rank, said in out.per_rank.items()}

    def close(self) -> None:
        self.client.close()
        for loop in self.loops:
            loop.stop()
        for t in self.threads:
            t.join(timeout=15)


@pytest.fixture
def two_buses(tmp_path, request):
    """Two buses (two engines) on one store: the host tier, or a Redis server."""
    if request.param == "file":
        url = f"file://{tmp_path / 'host-tier'}?budget=64MiB"
        server = None
    else:
        server = RedisServer(tmp_path / "redis").start()
        url = server.url
    buses = [Bus(tmp_path / f"bus{i}", url) for i in range(2)]
    yield buses, server
    for bus in buses:
        bus.close()
    if server is not None:
        server.stop()


def _filled(bus: Bus, rows: list[int], seed: int) -> dict:
    assert bus.run("fill", None, rows, tier="cpu", seed=seed).ok
    return bus.digests(rows)


@pytest.mark.parametrize("two_buses", ["file", "redis"], indirect=True)
def test_what_one_bus_puts_another_of_its_namespace_gets_bit_for_bit_and_no_other_namespace(two_buses):
    (a, b), _ = two_buses
    want = _filled(a, [1, 2, 3], seed=11)
    put = a.run("put", [1, 2, 3], keys=KEYS[:3], ns=NS)
    assert put.ok, put
    got = b.run("get", None, [7, 8, 9], keys=KEYS[:3], ns=NS)
    assert got.ok, got
    assert b.digests([7, 8, 9]) == want, "the other engine's rows are the bytes put, on every rank"
    miss = b.run("get", None, [10], keys=KEYS[:1], ns="another-model")
    assert miss.outcome == Outcome.FAILED and "store_miss" in miss.reason and miss.copies_over
    lost = b.run("swap_in", [10], [4])  # the row a failed get wrote is lost, never served
    assert lost.outcome == Outcome.FAILED and "lost_block" in lost.reason


def test_a_redis_store_that_is_down_slow_flushed_restarted_or_corrupt_fails_its_tasks_in_time(tmp_path):
    server = RedisServer(tmp_path / "redis", timeout=3.0).start()
    bus = Bus(tmp_path / "bus", server.url)
    try:
        _filled(bus, [1, 2], seed=3)
        assert bus.run("put", [1, 2], keys=KEYS[:2], ns=NS).ok

        # corrupt: one byte of a stored row flipped: the get fails, the row is lost, never served
        redis = server.client()
        name = name_of(NS, 0, KEYS[0])
        value = bytearray(redis.get(name))
        value[-1] ^= 0xFF
        redis.set(name, bytes(value))
        out = bus.run("get", None, [5], keys=KEYS[:1], ns=NS)
        assert out.outcome == Outcome.FAILED and "do not check" in out.reason

        # slow: a frozen server fails a get within the store's timeout (3 s), and the rank's copies
        # go on meanwhile, on the copy lane, never behind it
        server.freeze()
        started = time.monotonic()
        task = bus.client.submit("get", None, [6], timeout=30, keys=KEYS[1:2], ns=NS)
        swap = bus.run("swap_out", [3], [12])
        assert swap.ok and task in bus.client.book.open, "a copy waited on the store"
        out = bus.client.wait(task)
        assert out.outcome == Outcome.FAILED and "store_down" in out.reason
        assert time.monotonic() - started >= 3.0, "failed before the store's timeout: not the frozen server"
        server.thaw()

        # flushed: a miss, not an error
        redis.flushall()
        out = bus.run("get", None, [6], keys=KEYS[1:2], ns=NS)
        assert out.outcome == Outcome.FAILED and "store_miss" in out.reason

        # down, then restarted: failed at once while down, served again once back
        server.stop()
        out = bus.run("get", None, [6], keys=KEYS[1:2], ns=NS)
        assert out.outcome == Outcome.FAILED and "store_down" in out.reason
        server.start()
        assert bus.run("put", [2], keys=KEYS[1:2], ns=NS).ok
        assert bus.run("get", None, [6], keys=KEYS[1:2], ns=NS).ok
        assert bus.digests([6]) == bus.digests([2])
        redis.close()
    finally:
        bus.close()
        server.stop()


def test_a_rank_without_a_store_refuses_keyed_tasks_and_keeps_serving(tmp_path):
    bus = Bus(tmp_path / "bus", store=None)  # type: ignore[arg-type]
    try:
        out = bus.run("put", [1], keys=KEYS[:1], ns=NS)
        assert out.outcome == Outcome.FAILED and "no_store" in out.reason and out.copies_over
        assert bus.run("fill", None, [1], tier="cpu", seed=1).ok
    finally:
        bus.close()


def test_zkv_store_lists_namespaces_and_retires_one(tmp_path):
    from click.testing import CliRunner

    from zkv.cli.commands import main

    url = f"file://{tmp_path}?budget=1MiB"
    store = open_store(url)
    store.put([name_of("old", 0, b"a"), name_of("old", 0, b"b"), name_of("new", 0, b"a")], [b"x" * 10] * 3)
    listed = CliRunner().invoke(main, ["store", "ls", "--store", url, "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.output) == {"new": {"values": 1, "bytes": 10}, "old": {"values": 2, "bytes": 20}}
    retired = CliRunner().invoke(main, ["store", "retire", "--store", url, "old"])
    assert retired.exit_code == 0 and "old: 2 values retired" in retired.output
    assert store.namespaces() == {"new": (1, 10)}
    bad = CliRunner().invoke(main, ["store", "ls", "--store", "file:///tmp/x"])
    assert bad.exit_code == 2 and "budget" in bad.output
