"""One live worker per rank on a host, and a standby that takes over
(zkv/rank/tiers/rank_lock.py, docs/operations.md "A standby worker"): the lock
itself in one process, then real worker processes on a real broker (kill -9
the serving worker; the standby maps its CPU tier and disk tier again and
serves the exact blocks), and the restart benchmark's phase report."""

from __future__ import annotations

import os
import threading

import pytest
from profiles import long_e2e

from zkv.harness.bus.restart_bench import Bus, _phases, bench_restart, summary
from zkv.rank.tiers.rank_lock import RankBusy, RankLock, clean_locks
from zkv.rank.tiers.tier_file import TierPlace, list_tiers
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=1, gpu_blocks=16, cpu_blocks=32, block_size=4, kv_heads=2, head_dim=16)


def test_a_held_rank_lock_refuses_a_second_holder_and_a_waiter_gets_it_when_the_holder_stops(tmp_path):
    place = TierPlace("bus", 3, str(tmp_path))
    first, second = RankLock(place), RankLock(place)
    first.acquire()
    with pytest.raises(RankBusy) as busy:
        second.acquire()
    assert busy.value.pid > 0 and "zkv-rank-bus-r3.lock" in str(busy.value)
    other = RankLock(TierPlace("bus", 4, str(tmp_path)))
    other.acquire()  # another rank has a lock of its own

    waited, got = threading.Event(), threading.Event()
    waiter = threading.Thread(target=lambda: (second.acquire(True, lambda pid: waited.set()), got.set()))
    waiter.start()
    assert waited.wait(10) and not got.wait(0.2), "it waits while the first holds it"
    first.release()  # a clean stop unlinks the file: the waiter locks the path's new one
    assert got.wait(10)
    waiter.join(10)
    assert first.path.exists()
    with pytest.raises(RankBusy):
        RankLock(place).acquire()
    assert clean_locks(str(tmp_path), "bus") == [], "a held lock is never removed"
    second.release()
    assert not first.path.exists()
    left = RankLock(place)
    left.acquire()
    left._fd, fd = -1, left._fd  # as a killed worker leaves it: the file stays, nobody holds it
    os.close(fd)
    assert clean_locks(str(tmp_path), "other") == [] and clean_locks(str(tmp_path)) == [first.path]
    assert other.path.exists(), "rank 4's lock is held"
    other.release()


def test_a_standby_worker_takes_over_a_killed_one_and_serves_its_cpu_and_disk_blocks_exact(tmp_path):
    tiers = ["--tier-dir", str(tmp_path / "tiers"), "--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "64"]
    bus = Bus(LAYOUT, [*tiers, "--liveness-ms", "1000"], tmp_path / "workers.log")
    try:
        bus.start()
        c = bus.client
        assert c.run("fill", None, [1, 2, 3], tier="gpu", seed=3, timeout=30).ok
        want = c.run("checksum", [1, 2, 3], tier="gpu", timeout=30).per_rank[0]["digests"]
        assert c.run("swap_out", [1, 2, 3], [10, 11, 12], timeout=30).ok
        assert c.run("spill", [10, 11, 12], [0, 1, 2], timeout=30).ok
        serving = bus.worker[0].pid

        dup, marks, _ = bus.spawn()  # a second worker of the rank, not a standby
        assert dup.wait(timeout=60) == 1
        marks.close()
        assert f"rank 0 of this bus is served on this host by pid {serving}" in bus.log.read_text()

        proc, marks, _ = bus.spawn("--standby")
        marks.wait_for("standby", proc)  # started: torch and every module loaded
        assert f"standby: pid {serving} serves it here" in bus.log.read_text()
        t_kill = bus.kill()
        ok = bus.first_task(proc, marks, lambda: c.run("swap_in", [10, 11, 12], [4, 5, 6], timeout=30))
        print(f"\nstandby takeover: kill -> first task ok {ok - t_kill:.3f} s {_phases(marks.marks, t_kill, ok)}")
        assert c.run("checksum", [4, 5, 6], tier="gpu", timeout=30).per_rank[0]["digests"] == want
        assert c.run("checksum", [0, 1, 2], tier="disk", timeout=30).per_rank[0]["digests"] == want
        st = c.status()
        assert "CPU blocks kept" in st.gen_reason and st.ranks[0].pid == proc.pid
        assert [t.rank for t in list_tiers(str(tmp_path / "tiers")) if t.owned] == [0], "the standby holds the tier"
    finally:
        bus.close()


def test_the_phases_are_reported_in_the_order_they_ended_whatever_the_mark_order():
    marks = {"interpreter": 10.1, "cli": 10.3, "lock": 10.35, "imports": 13.0, "tiers": 13.02, "welcome": 13.03}
    got = _phases(marks, 10.0, 13.05)
    assert list(got) == [
        "python",
        "cli_imports",
        "rank_lock",
        "rank_imports",
        "tiers",
        "register",
        "resume_and_first_task",
    ]
    assert got["rank_imports"] == pytest.approx(2650) and sum(got.values()) == pytest.approx(3050)
    standby = _phases({"interpreter": 1.0, "imports": 4.0, "lock": 9.1, "tiers": 9.13}, 9.0, 9.2)
    assert list(standby) == ["rank_lock", "tiers", "resume_and_first_task"], "marks before the kill are not its phases"


@long_e2e("five worker starts, each importing torch, 30-60 s", "test_a_standby_worker_takes_over_a_killed_one")
def test_the_restart_benchmark_reports_each_start_beside_its_baselines(tmp_path):
    res = bench_restart(4 << 20, 1 << 20, rounds=1, directory=str(tmp_path), say=lambda m: None)
    assert res["exact"] and "CPU blocks kept" in res["gen_reason"]
    for name in ("fresh_start_no_tiers", "restart_with_tiers", "standby_takeover"):
        assert res[name]["total_s"] > 0 and "resume_and_first_task" in res[name]["phases_ms"]
    assert res["standby_takeover"]["total_s"] < res["restart_with_tiers"]["total_s"]
    assert "rank_imports" in res["restart_with_tiers"]["phases_ms"]
    assert "standby takeover (kill -> first task ok)" in summary(res)
