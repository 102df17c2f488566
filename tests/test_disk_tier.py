"""The disk tier (docs/protocol.md §6, `spill` / `load`): real files on tmpfs
and on a disk-backed directory, the store with a persistent CPU tier above it,
and real rank processes for the round trip, a torn block and a kill -9 in the
middle of spills.

The default run is short: one disk-backed round trip, the store rules and two
real-rank tests.  ``ZKV_DISK_LONG=1`` adds the repetitions (tmpfs, an aligned
row size) and the pause-after-spills test on a real rank."""

import ctypes
import errno
import os
import signal
import time
import zlib

import pytest
import torch
from waits import wait_for

from zkv.harness.bus.cluster import LocalCluster
from zkv.obs.status_view import render_status
from zkv.rank.errors import CacheError
from zkv.rank.store import BlockStore
from zkv.rank.tiers import disk_io
from zkv.rank.tiers.cpu_tier import CpuTier
from zkv.rank.tiers.disk_tier import DiskLost, DiskSpec, DiskTier
from zkv.rank.tiers.tier_file import TierFile, TierPlace, list_tiers
from zkv.wire.layout import CacheLayout

LONG = os.environ.get("ZKV_DISK_LONG") == "1"
long_only = pytest.mark.skipif(not LONG, reason="set ZKV_DISK_LONG=1 for the longer disk tier tests")

ROW = 8192 + 100  # not a multiple of the alignment: the bounce path under O_DIRECT
KEY = b"k" * 16


@pytest.fixture(params=["disk", "tmpfs"])
def where(request, tmp_path):
    if request.param == "disk":
        yield str(tmp_path / "disk")  # a disk-backed file system (ext4 here): O_DIRECT
        return
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = f"/dev/shm/zkv-test-{os.getpid()}-{tmp_path.name}"
    yield d
    for name in os.listdir(d) if os.path.isdir(d) else ():
        os.unlink(os.path.join(d, name))
    if os.path.isdir(d):
        os.rmdir(d)


def rows_of(t: torch.Tensor, ids) -> list[int]:
    return [t.data_ptr() + i * t.stride(0) for i in ids]


@pytest.mark.parametrize("row", [ROW, pytest.param(8192, marks=long_only)])
def test_blocks_round_trip_exactly_survive_a_reopen_and_a_torn_row_is_lost(where, row):
    src = torch.randint(0, 256, (40, row), dtype=torch.uint8)
    tier = DiskTier(DiskSpec(where, 80), row, KEY)
    ids = [5, 6, 7, 30, 2] + list(range(40, 75))  # runs and strays, out of order
    assert tier.write(ids, rows_of(src, range(40))) == 40 * row
    out = torch.zeros_like(src)
    tier.read(ids, rows_of(out, range(40)))
    assert torch.equal(out, src)
    with pytest.raises(DiskLost, match="disk blocks 0 hold no block") as empty:
        tier.read([0], rows_of(out, [0]))
    assert empty.value.code == "disk_lost"
    tier.close()

    again = DiskTier(DiskSpec(where, 80), row, KEY)
    assert again.reopened == 40 and again.open_seconds < 2.0
    with open(again.path, "r+b") as f:  # tear block 30: part of its row, behind the tier's back
        f.seek(again.data_off + 30 * again.slot + 100)
        f.write(b"\xff" * 64)
    out.zero_()
    with pytest.raises(DiskLost, match="disk blocks 30 failed their digest check") as torn:
        again.read([6, 30, 7], rows_of(out, [0, 1, 2]))
    assert torn.value.rows == [30] and again.to_stats()["digest_failures"] == 1
    again.read([6, 7], rows_of(out, [0, 1]))
    assert torch.equal(out[:2], src[1:3]), "the blocks beside a torn one still read back exactly"
    again.close()

    other = DiskTier(DiskSpec(where, 80), row, b"j" * 16)  # another layout: never reused
    assert other.reopened == 0 and other.used == 0
    other.close()


def test_a_record_changed_on_the_device_is_caught_at_the_next_open_a_live_tier_reads_its_own(tmp_path):
    """A live tier holds its records in memory (read at open, written through at each
    spill): every read checks that copy, then the bytes read from the device against
    its digest. So a changed record on the device does not change what a live rank
    serves (its blocks' bytes still check), and the next open refuses the block."""
    src = torch.randint(0, 256, (3, ROW), dtype=torch.uint8)
    tier = DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY)
    tier.write([1, 2, 3], rows_of(src, range(3)))
    with open(tier.path, "r+b") as f:  # the magic of block 2's record, behind the tier's back
        f.seek(disk_io.ALIGN + 2 * 32)
        f.write(b"\xff")
    out = torch.zeros_like(src)
    tier.read([1, 2, 3], rows_of(out, range(3)))
    assert torch.equal(out, src), "the live tier serves the blocks its own records vouch for"
    tier.close()
    again = DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY)
    assert again.reopened == 2
    with pytest.raises(DiskLost, match="disk blocks 2 hold no block"):
        again.read([2], rows_of(out, [0]))
    again.close()


def test_invalidate_drops_every_block_and_a_second_process_cannot_open_a_held_file(tmp_path):
    src = torch.randint(0, 256, (4, ROW), dtype=torch.uint8)
    tier = DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY)
    tier.write([0, 1, 2, 3], rows_of(src, range(4)))
    with pytest.raises(CacheError, match="held by another live process"):
        DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY)
    tier.invalidate()
    assert tier.used == 0
    with pytest.raises(DiskLost, match="hold no block"):
        tier.read([1], rows_of(src, [0]))
    tier.close()
    assert DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY).reopened == 0


def test_a_file_system_that_refuses_o_direct_falls_back_to_buffered_io(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(disk_io, "_probed", {})
    tier = DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY)
    assert tier.direct is False and tier.slot == ROW
    src = torch.randint(0, 256, (3, ROW), dtype=torch.uint8)
    tier.write([7, 0, 3], rows_of(src, range(3)))
    out = torch.zeros_like(src)
    tier.read([7, 0, 3], rows_of(out, range(3)))
    assert torch.equal(out, src)
    tier.close()


def test_a_disk_file_holds_one_cpu_generation_and_a_file_of_an_older_format_is_made_anew(tmp_path):
    src = torch.randint(0, 256, (4, ROW), dtype=torch.uint8)
    out = torch.zeros_like(src)
    tier = DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY, cpu_gen=3)
    tier.write([0, 1, 2, 3], rows_of(src, range(4)))
    tier.close()
    again = DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY, cpu_gen=0)  # the file's generation wins
    assert (again.cpu_gen, again.reopened, again.kept) == (3, 4, True)
    again.set_cpu_gen(4)  # the bus left generation 3: every block of it is gone
    assert (again.used, again.kept) == (0, False)
    with pytest.raises(DiskLost, match="hold no block"):
        again.read([1], rows_of(out, [0]))
    again.write([5], rows_of(src, [1]))
    again.close()
    third = DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY)
    assert (third.cpu_gen, third.reopened) == (4, 1), "the move and the block after it were on the device"
    third.read([5], rows_of(out, [0]))
    assert torch.equal(out[0], src[1])
    path, epoch_at = third.path, 8 + 4 + 4 + 8 * 4  # the superblock's version 1 layout: epoch, alg, key, no cpu_gen
    third.close()
    with open(path, "r+b") as f:  # what a version-1 file holds: no cpu_gen, its blocks valid at its epoch
        head = bytearray(f.read(epoch_at + 4 + 32))
        head[8:12] = (1).to_bytes(4, "little")
        f.seek(0)
        f.write(bytes(head) + zlib.crc32(bytes(head)).to_bytes(4, "little"))
    old = DiskTier(DiskSpec(str(tmp_path), 8), ROW, KEY, cpu_gen=4)
    assert (old.reopened, old.kept, old.cpu_gen) == (0, False, 4), "an older format is never read"
    old.close()


def test_the_row_digest_is_the_multilinear_hash_of_the_words_and_catches_any_one_word_changed():
    mask = 2**64 - 1
    rows = torch.randint(0, 256, (3, ROW + 8), dtype=torch.uint8)  # ROW % 8 == 4: a zero-padded last word
    digest = disk_io.RowDigest(ROW, seed=99)
    weights = [int(w) & mask for w in disk_io.mh64_weights(99, ROW // 8 + 1)]

    def reference(row: bytes) -> bytes:
        words = [int.from_bytes(row[i : i + 8], "little") for i in range(0, len(row), 8)]
        return (sum(w * x for w, x in zip(weights, words)) & mask).to_bytes(8, "little") + bytes(8)

    addrs = [rows.data_ptr() + 3, rows.data_ptr() + 3 + ROW + 8, rows.data_ptr() + 3 + 2 * (ROW + 8), rows.data_ptr()]
    got = digest.of(addrs)  # three evenly spaced (one numpy pass) and a stray, none 8-byte aligned
    assert got == [reference(ctypes.string_at(a, ROW)) for a in addrs]
    flat = rows.view(-1)
    for byte, bit in [(3, 0), (3 + 7, 7), (3 + 4000, 3), (3 + ROW - 1, 7)]:  # a word's low and top bits, the tail
        flat[byte] ^= 1 << bit
        assert digest.of(addrs[:1]) != got[:1], (byte, bit)
        flat[byte] ^= 1 << bit
    assert digest.of(addrs[:1]) == got[:1]
    assert disk_io.RowDigest(ROW, seed=100).of(addrs[:1]) != got[:1], "another file's seed, other weights"


LAYOUT = CacheLayout(layers=1, gpu_blocks=8, cpu_blocks=16, block_size=4, kv_heads=2, head_dim=16)


def test_the_store_keeps_the_disk_tier_with_keep_cpu_and_drops_it_on_a_clear_or_a_new_layout(tmp_path):
    store = BlockStore.owned(LAYOUT, disk=DiskSpec(str(tmp_path), 32))
    store.fill("cpu", [0, 1], seed=3)
    store.move("spill", [0, 1], [10, 11])
    want = store.checksum("cpu", [0, 1])
    assert store.checksum("disk", [10, 11]) == want
    store.free(keep_cpu=True)
    store.allocate(LAYOUT)
    assert store.checksum("disk", [10, 11]) == want, "keep_cpu keeps the disk tier"
    store.free(keep_cpu=False)
    store.allocate(LAYOUT)
    with pytest.raises(DiskLost):
        store.move("load", [10], [0])
    with pytest.raises(CacheError, match=r"lost_block.*\[0\] hold nothing"):
        store.move("spill", [0], [3])  # the failed load left CPU row 0 holding nothing: never spilled as zeros
    store.fill("cpu", [0], seed=4)
    store.move("spill", [0], [3])
    store.allocate(LAYOUT.with_changes(head_dim=32))  # a resume with a new layout
    with pytest.raises(DiskLost):
        store.checksum("disk", [3])
    store.close()


def test_with_a_persistent_cpu_tier_spill_checks_rows_load_seals_them_and_close_keeps_both_files(tmp_path):
    place, disk = TierPlace("bus", 0, str(tmp_path / "shm")), DiskSpec(str(tmp_path / "disk"), 32)
    store = BlockStore.owned(LAYOUT, place=place, disk=disk)
    store.fill("cpu", [0, 1, 2], seed=4)
    want = store.checksum("cpu", [0, 1])
    store.tier.file.heads[2, 0] ^= 0xFF  # a torn header: CPU block 2 is lost
    with pytest.raises(CacheError, match=r"lost_block.*\[2\]"):
        store.move("spill", [1, 2], [5, 6])
    assert store.disk.used == 0, "a spill naming a lost CPU block writes nothing"
    store.move("spill", [0, 1], [5, 6])
    store.move("load", [5, 6], [2, 3])  # a load seals the rows it writes: block 2 is whole again
    assert store.checksum("cpu", [2, 3]) == want
    with pytest.raises(DiskLost):
        store.move("load", [7], [0])  # nothing there: CPU row 0 now holds undefined bytes
    with pytest.raises(CacheError, match="lost_block"):
        store.checksum("cpu", [0])
    store.close()  # the rank stops: the tier file and the disk file both stay
    again = BlockStore.owned(LAYOUT, place=place, disk=disk)
    assert again.restored and again.disk.reopened == 2
    assert again.checksum("cpu", [2, 3]) == want == again.checksum("disk", [5, 6])
    again.free()  # a clear: the tier file goes and the disk blocks are dropped
    assert list(list_tiers(place.directory)) == []
    again.allocate(LAYOUT)
    with pytest.raises(DiskLost):
        again.checksum("disk", [5])
    again.close()


def test_disk_blocks_belong_to_the_cpu_generation_of_the_store_across_restarts(tmp_path):
    place, disk = TierPlace("bus", 0, str(tmp_path / "shm")), DiskSpec(str(tmp_path / "disk"), 32)
    store = BlockStore.owned(LAYOUT, place=place, disk=disk)
    store.set_cpu_gen(5)  # a task at the bus's CPU generation 5
    store.fill("cpu", [0, 1], seed=6)
    store.move("spill", [0, 1], [10, 11])
    want = store.checksum("cpu", [0, 1])
    store.close()

    again = BlockStore.owned(LAYOUT, place=place, disk=disk)  # a restart: both tiers at 5
    assert again.kept_tiers(fresh=True) == {"kept_tiers": ["cpu", "disk"], "cpu_gen": 5}
    assert again.checksum("disk", [10, 11]) == want
    again.set_cpu_gen(6)  # the bus moved on (a clear this rank missed): the disk blocks go with the CPU rows
    with pytest.raises(DiskLost, match="hold no block"):
        again.move("load", [10], [0])
    assert again.kept_tiers(fresh=False) == {"kept_tiers": ["cpu", "disk"], "cpu_gen": 6}
    with pytest.raises(CacheError, match="lost_block"):
        again.move("spill", [1], [12])  # the CPU rows of 5 are gone too
    again.fill("cpu", [1], seed=7)
    later = again.checksum("cpu", [1])
    again.move("spill", [1], [12])
    again.close()

    memory_only = BlockStore.owned(LAYOUT, disk=disk)  # a new CPU tier: the store takes the file's generation
    assert memory_only.cpu_gen == 6 and memory_only.kept_tiers(fresh=True) == {"kept_tiers": ["disk"], "cpu_gen": 6}
    assert memory_only.checksum("disk", [12]) == later
    memory_only.set_cpu_gen(7)
    memory_only.fill("cpu", [0], seed=8)
    memory_only.move("spill", [0], [13])
    memory_only.close()

    behind = BlockStore.owned(LAYOUT, place=place, disk=disk)  # CPU tier at 6, disk blocks at 7
    assert behind.restored and behind.cpu_gen == 6
    assert behind.kept_tiers(fresh=True) == {"kept_tiers": ["cpu"], "cpu_gen": 6}, "disk blocks of 7 are not kept"
    with pytest.raises(DiskLost):
        behind.checksum("disk", [13])
    behind.close()


CHEAP = 16 * 4096 - 1000  # 1000 bytes short of 16 pages: padded to them (under 1/16 more memory)


@pytest.mark.parametrize("in_file", [False, True])
def test_cpu_tier_rows_start_page_aligned_so_spill_and_load_skip_the_bounce_buffer(tmp_path, in_file):
    place = TierPlace("bus", 0, str(tmp_path / "shm")) if in_file else None
    tier = CpuTier([("k", CHEAP - 20000), ("v", 20000)], 6, pin=False, place=place)
    assert tier.stride == tier.store.stride(0) == 16 * 4096 and tier.nbytes == 6 * 16 * 4096
    assert all(tier.store[r].data_ptr() % 4096 == 0 for r in range(6))
    packed = CpuTier([("k", ROW)], 3, pin=False)  # 8292 -> 12288 would cost half again: kept packed
    assert packed.stride == ROW and packed.store.data_ptr() % 4096 == 0
    disk = DiskTier(DiskSpec(str(tmp_path / "disk"), 8), tier.row_bytes, KEY)
    tier.writing(range(6))
    tier.store.copy_(torch.randint(0, 256, (6, tier.row_bytes), dtype=torch.uint8))
    tier.written(range(6))
    want = tier.store.clone()
    disk.write([3, 4, 5, 0], tier.addresses([0, 1, 2, 5]), tier.stride)  # a run of three rows and a stray
    tier.store.zero_()
    disk.read([5, 3, 4, 0], tier.addresses([2, 0, 1, 5]), tier.stride)
    assert torch.equal(tier.store[[0, 1, 2, 5]], want[[0, 1, 2, 5]])
    assert disk._bounces == {}, "no row went through a bounce buffer"
    disk.close()
    tier.close()
    if in_file:  # a file of padded rows maps again; one of packed rows (version 1) is never read as one
        again = CpuTier([("k", CHEAP - 20000), ("v", 20000)], 6, pin=False, place=place)
        assert again.kept and torch.equal(again.store[[0, 1, 2, 5]], want[[0, 1, 2, 5]])
        again.close(unlink=True)
        packed_file = TierFile(place, "k", 2, CHEAP)
        packed_file.close()
        assert not TierFile(place, "k", 2, CHEAP, stride=16 * 4096).kept


# --- real processes ------------------------------------------------------------------

E2E = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=64, block_size=16, kv_heads=4, head_dim=64)  # 32 KiB blocks
FAST = ["--heartbeat-ms", "100", "--liveness-ms", "1000", "--op-timeout-ms", "10000"]


def _cluster(tmp_path, disk_dir: str) -> LocalCluster:
    args = ["--liveness-ms", "1000", "--disk-dir", disk_dir, "--disk-blocks", "1024"]
    return LocalCluster(1, E2E, quiet=True, broker_args=FAST, worker_args=args, directory=tmp_path / "c")


@pytest.fixture(scope="module")
def rank_cluster(tmp_path_factory):
    """One rank with its disk tier in a disk-backed directory (each spill ends with
    an fdatasync of real I/O), shared by the tests below in file order: the kill -9
    test restarts the rank and uses disk ids the round trip does not."""
    base = tmp_path_factory.mktemp("e2e")
    where = str(base / "disk")
    with _cluster(base, where) as c:
        yield c, where


def test_spill_and_load_round_trip_exact_bytes_and_a_torn_block_fails_naming_it(rank_cluster):
    cluster, where = rank_cluster
    with cluster.client(request_timeout=15) as client:
        rows = list(range(32))
        assert client.run("fill", None, rows, tier="cpu", seed=11).ok
        want = client.run("checksum", rows, tier="cpu").per_rank[0]["digests"]
        spill = client.run("spill", rows, [100 + r for r in rows])
        assert spill.ok and spill.bytes == 32 * E2E.block_bytes, spill.reason
        assert client.run("fill", None, rows, tier="cpu", seed=12).ok  # the CPU rows now hold other bytes
        assert client.run("load", [100 + r for r in reversed(rows)], list(reversed(rows))).ok
        assert client.run("checksum", rows, tier="cpu").per_rank[0]["digests"] == want
        assert client.run("checksum", [100 + r for r in rows], tier="disk").per_rank[0]["digests"] == want

        path = os.path.join(where, "zkv-rank0.disk")
        data_off = disk_io.ALIGN + disk_io.align_up(1024 * 32)  # superblock, 32-byte records (disk_tier.py)
        with open(path, "r+b") as f:  # 32 KiB blocks: a slot is a block either way
            f.seek(data_off + 105 * E2E.block_bytes + 4000)
            f.write(b"\x00" * 512)
        torn = client.run("load", [104, 105, 106], [0, 1, 2])
        assert torn.outcome == "failed" and "disk_lost" in torn.reason and "105" in torn.reason, torn.reason
        assert client.run("spill", [0], [2000]).outcome == "failed", "a disk id out of range"
        assert client.run("fill", None, [1], tier="disk").outcome == "failed", "fill is not offered on disk"
        disk = disk_stats(client, lambda d: d["digest_failures"] == 1)  # stats travel with heartbeats
        assert disk["used"] == 32 and disk["blocks"] == 1024 and disk["bytes"] >= 1024 * E2E.block_bytes
        assert "rank 0 disk: 32/1024 blocks" in render_status(client.status().as_dict()), "zkv status shows the tiers"


def disk_stats(client, predicate, timeout: float = 10.0) -> dict:
    """Rank 0's disk stats once ``predicate`` holds (each status call is one bounded round trip)."""
    deadline = time.monotonic() + timeout
    while True:
        disk = client.status().ranks[0].stats.get("disk")
        if disk is not None and predicate(disk):
            return disk
        assert time.monotonic() < deadline, disk
        time.sleep(0.05)


def test_kill_9_in_the_middle_of_spills_loses_no_acked_block_and_serves_no_torn_one(rank_cluster):
    cluster, _ = rank_cluster
    per, tasks, base = 32, 24, 200  # disk ids 200..967: none the round trip above wrote
    with cluster.client(request_timeout=20) as client:
        rows = list(range(per))
        assert client.run("fill", None, rows, tier="cpu", seed=5).ok
        want = client.run("checksum", rows, tier="cpu").per_rank[0]["digests"]
        ids = {client.submit("spill", rows, [base + i * per + r for r in rows], timeout=30): i for i in range(tasks)}
        acked: list[int] = []
        deadline = time.monotonic() + 30
        while len(acked) < 3 and time.monotonic() < deadline:
            acked += [ids[o.task] for o in client.poll(0.5) if o.ok]
        cluster.kill_worker(0, signal.SIGKILL)
        assert len(acked) >= 3, "spills ended ok before the kill"
        assert len(acked) < tasks, "the kill landed with spills still to run"
        pid = cluster.start_worker(0).pid
        deadline = time.monotonic() + 60
        while True:  # the restarted process registered, serving at the bus's generation
            st = client.status(wait_ranks=1, timeout=30)
            r = st.ranks[0]
            if st.state == "running" and r.pid == pid and r.alive and r.stats.get("gen") == st.gen:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        for o in client.poll(0.0):  # outcomes that arrived after the kill
            if o.ok:
                acked.append(ids[o.task])
        assert r.stats["disk"]["reopened"] >= len(acked) * per
        for i in range(tasks):
            out = client.run("checksum", [base + i * per + r for r in rows], tier="disk")
            if i in acked:
                assert out.ok, f"acked spill {i}: {out.reason}"
            if out.ok:
                assert out.per_rank[0]["digests"] == want, f"spill {i} served other bytes"
            else:
                assert "disk_lost" in out.reason, out.reason
        first = min(acked)
        assert client.run("load", [base + first * per + r for r in rows], rows).ok
        assert client.run("checksum", rows, tier="cpu").per_rank[0]["digests"] == want


@long_only
def test_a_pause_waits_for_the_spills_in_flight(rank_cluster):
    cluster, _ = rank_cluster
    with cluster.client(request_timeout=20) as client:
        rows = list(range(64))
        spills = [client.submit("spill", rows, [i * 64 + r for r in rows], timeout=30) for i in range(8)]
        client.pause()
        st = client.status()
        assert st.inflight == 0 and st.ranks[0].inflight == 0, "the ack came after every spill ended"
        assert all(client.wait(t, timeout=10).ok for t in spills), "dispatched spills finished, none cancelled"
        client.resume()


def test_a_clear_while_a_rank_is_down_drops_its_disk_blocks_and_a_keep_cpu_clear_keeps_them(tmp_path, monkeypatch):
    monkeypatch.setenv("ZKV_TIER_DIR", str(tmp_path / "tiers"))  # the workers and LocalCluster.stop read it
    args = ["--liveness-ms", "1000", "--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "64"]
    cluster = LocalCluster(2, E2E, quiet=True, broker_args=FAST, worker_args=args, directory=tmp_path / "c")
    rows = list(range(8))
    with cluster, cluster.client(request_timeout=15) as client:

        def spilled(seed: int, disk: list[int]) -> dict:
            assert client.run("fill", None, rows, tier="cpu", seed=seed).ok
            want = client.run("checksum", rows, tier="cpu").per_rank
            assert client.run("spill", rows, disk).ok
            assert client.run("fill", None, rows, tier="cpu", seed=seed + 1).ok  # the CPU rows hold other bytes
            return want

        def loads_exactly(disk: list[int], want: dict) -> None:
            out = client.run("load", disk, rows)
            assert out.ok, out.reason
            got = client.run("checksum", rows, tier="cpu").per_rank
            assert all(got[r]["digests"] == want[r]["digests"] for r in (0, 1)), "each rank read its own bytes back"

        before = list(range(8))
        spilled(1, before)
        cluster.kill_worker(1)  # kill -9: its tier file and disk file stay, at the CPU generation of the spill
        wait_for(client, lambda s: not s.ranks[1].alive, "rank 1 declared dead")
        client.pause()
        assert client.clear().cpu_gen == 1, "a clear without keep_cpu: CPU content gone, on rank 0 only"
        client.resume()
        pid = cluster.start_worker(1).pid
        wait_for(
            client,
            lambda s: s.state == "running" and all(r.alive for r in s.ranks) and s.ranks[1].pid == pid,
            "the restarted rank 1",
        )
        old = client.run("load", before, rows)
        assert old.outcome == "failed", "blocks of the cleared CPU generation are never served"
        for r in (0, 1):
            assert old.per_rank[r]["outcome"] == "failed" and "disk_lost" in old.per_rank[r]["reason"], old.per_rank

        after = list(range(20, 28))
        loads_exactly(after, spilled(3, after))

        kept = list(range(40, 48))
        want = spilled(5, kept)
        client.pause()
        client.clear(keep_cpu=True)
        client.resume()
        loads_exactly(kept, want)
        loads_exactly(after, spilled(7, after))  # and the disk tier takes new blocks at the same CPU generation
