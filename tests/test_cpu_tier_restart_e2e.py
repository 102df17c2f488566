"""A rank's CPU tier outlives the rank process (docs/protocol.md §8.2,
§10.1), on real worker processes and real tier files: kill -9 a worker
after a swap_out, tear one block's header while it is down, restart it;
the same for a worker attached to an engine process's memory."""

import os
import signal
import subprocess
import sys
import time

import pytest
from scrapes import free_port, scrape, value
from waits import wait_for

from zkv.harness.bus.attached_cluster import AttachedCluster
from zkv.harness.bus.cluster import LocalCluster
from zkv.obs.status_view import render_status
from zkv.rank.tiers.tier_file import WRITING, list_tiers, row_head_offset
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=1, gpu_blocks=32, cpu_blocks=64, block_size=4, kv_heads=2, head_dim=16)
FAST = ["--heartbeat-ms", "100", "--liveness-ms", "1000", "--op-timeout-ms", "10000"]


@pytest.fixture
def tier_dir(tmp_path, monkeypatch):
    where = tmp_path / "tiers"
    monkeypatch.setenv("ZKV_TIER_DIR", str(where))  # the workers and LocalCluster.stop read it
    return where


def tear_header(path, rows: int, row_bytes: int, row: int) -> None:
    """Leave a row as a kill in the middle of its write leaves it (the rank is
    down): its mark says "being written", so its header no longer checks."""
    with open(path, "r+b") as f:
        f.seek(row_head_offset(rows, row_bytes, row))
        f.write(WRITING)


def test_kill_9_after_swap_out_keeps_the_cpu_blocks_moves_only_the_gpu_generation_and_a_torn_one_fails(
    tmp_path, tier_dir
):
    port = free_port()
    broker = [*FAST, "--metrics-port", str(port)]
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=broker, worker_args=["--liveness-ms", "1000"])
    try:
        c.start(timeout=60)
        with c.client(request_timeout=15) as client, c.client(request_timeout=15) as other:
            assert client.run("fill", None, [1, 2, 3], tier="gpu", seed=5, timeout=10).ok
            assert client.run("swap_out", [1, 2, 3], [10, 11, 12], timeout=10).ok
            before = client.run("checksum", [10, 11, 12], tier="cpu", timeout=10)
            assert before.ok and other.run("checksum", [10], tier="cpu", timeout=10).ok
            assert other.gen == 0 and other.cpu_gen == 0

            c.kill_worker(1)  # SIGKILL: no cleanup runs
            (mine,) = [t for t in list_tiers(str(tier_dir)) if t.rank == 1]
            assert not mine.owned, "the dead worker's lock went with it"
            tear_header(mine.path, mine.rows, mine.row_bytes, 11)

            started = time.monotonic()
            c.start_worker(1)
            st = wait_for(
                client,
                lambda s: s.gen == 1 and s.state == "running" and all(r.alive for r in s.ranks),
                "the restarted rank",
            )
            print(f"\nrank restart with its CPU tier kept: serving again after {time.monotonic() - started:.2f} s")
            assert st.cpu_gen == 0 and "GPU blocks of generation 0 are gone; CPU blocks kept" in st.gen_reason

            back = other.run("swap_in", [10, 12], [4, 5], timeout=10)
            assert back.ok and other.gen == 1 and other.cpu_gen == 0, "gen moved, cpu_gen did not"
            after = other.run("checksum", [4, 5], tier="gpu", timeout=10)
            for r in (0, 1):
                want = before.per_rank[r]["digests"]
                assert after.per_rank[r]["digests"] == [want[0], want[2]], f"rank {r}: exact bytes back"

            torn = other.run("swap_in", [11], [6], timeout=10)
            assert torn.outcome == "failed" and "lost_block" in torn.reason and "[11]" in torn.reason
            assert torn.per_rank[0]["outcome"] == "ok", "rank 0's block 11 is intact"
            st = wait_for(client, lambda s: s.ranks[1].stats["cpu_tier"]["digest_failures"], "the stats")
            tier = st.ranks[1].stats["cpu_tier"]
            assert tier["used"] == 2 and tier["kept"] and tier["file"] == str(mine.path)
            lines = render_status(st.as_dict()).splitlines()
            kept = f"rank 1 cpu: 2/64 blocks (32.0 KiB, kept from an earlier process, file {mine.path}, "
            kept += "1 digest failures)"
            assert kept in lines
            assert any(x.startswith("rank 0 cpu: ") and ", fresh, " in x for x in lines), "rank 0 never restarted"
            metrics = scrape(f"http://127.0.0.1:{port}/metrics")
            assert value(metrics, "zkv_tier_kept", rank="1", tier="cpu") == 1
            assert value(metrics, "zkv_tier_kept", rank="0", tier="cpu") == 0
            assert value(metrics, "zkv_tier_blocks_used", rank="1", tier="cpu") == 2
            assert value(metrics, "zkv_tier_digest_failures_total", rank="1", tier="cpu") == 1
    finally:
        c.stop()
    assert list(list_tiers(str(tier_dir))) == [], "a clean stop leaves no CPU tier behind"


def test_a_tier_a_clear_emptied_after_a_restart_is_shown_fresh_not_kept(tmp_path, tier_dir):
    port = free_port()
    disk = ["--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "64"]
    c = LocalCluster(
        2,
        LAYOUT,
        quiet=True,
        broker_args=[*FAST, "--metrics-port", str(port)],
        worker_args=["--liveness-ms", "1000", *disk],
    )
    try:
        c.start(timeout=60)
        with c.client(request_timeout=15) as client:
            assert client.run("fill", None, [1, 2], tier="gpu", seed=5, timeout=10).ok
            assert client.run("swap_out", [1, 2], [10, 11], timeout=10).ok
            assert client.run("spill", [10, 11], [20, 21], timeout=10).ok
            c.kill_worker(1)
            c.start_worker(1)
            wait_for(
                client, lambda s: s.gen == 1 and s.state == "running" and all(r.alive for r in s.ranks), "the restart"
            )

            def rank1() -> tuple[list[str], dict]:
                client.pause()  # the acks carry the ranks' fresh stats
                st = client.status()
                lines = [x for x in render_status(st.as_dict()).splitlines() if x.startswith("rank 1 ")]
                return lines, scrape(f"http://127.0.0.1:{port}/metrics")

            lines, metrics = rank1()
            assert any("cpu: 2/64" in x and "kept from an earlier process" in x for x in lines), lines
            assert any("disk: 2/64" in x and "reopened" in x for x in lines), lines
            assert value(metrics, "zkv_tier_kept", rank="1", tier="cpu") == 1
            assert value(metrics, "zkv_tier_kept", rank="1", tier="disk") == 1
            client.clear()  # without keep_cpu: every CPU and disk block is gone
            client.resume()
            lines, metrics = rank1()
            assert any("cpu: 0/64" in x and ", fresh, " in x for x in lines), lines
            assert any("disk: 0/64" in x and ", fresh, " in x for x in lines), lines
            assert value(metrics, "zkv_tier_kept", rank="1", tier="cpu") == 0
            assert value(metrics, "zkv_tier_kept", rank="1", tier="disk") == 0
            client.resume()
    finally:
        c.stop()


def test_zkv_tier_lists_a_killed_rank_s_tier_as_kept_for_its_restart_and_cleans_only_the_orphans(tmp_path, tier_dir):
    """A killed rank's tier is what its restart maps again: listed as kept for it, left by clean --bus / --all
    unless --with-kept; an earlier layout's tier of the same rank is an orphan, removed."""
    from zkv.rank.tiers.tier_file import TierFile, TierPlace

    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=FAST, worker_args=["--liveness-ms", "1000"])
    try:
        c.start(timeout=60)
        c.workers[1].send_signal(signal.SIGKILL)
        c.workers[1].wait(timeout=10)
        bus = next(t.bus for t in list_tiers(str(tier_dir)))
        old = TierFile(TierPlace(bus, 1, str(tier_dir)), ("an earlier layout",), rows=4, row_bytes=64)
        old.close()
        os.utime(old.path, (1, 1))  # written long before the rank's tier of today's layout
        env = dict(os.environ, PYTHONPATH=os.getcwd())

        def zkv(*args: str) -> str:
            out = subprocess.run([sys.executable, "-m", "zkv", "tier", *args], capture_output=True, text=True, env=env)
            assert out.returncode == 0, out.stderr
            return out.stdout

        listing = zkv("list").splitlines()
        assert any("rank 0" in x and "held by pid" in x for x in listing), listing
        assert any(
            "rank 1" in x and "kept for a restart of rank 1 (its bus runs here: rank 0 held)" in x for x in listing
        ), listing
        assert any(str(old.path) in x and "orphan: rank 1 of this bus has a newer tier" in x for x in listing), listing
        refused = subprocess.run(
            [sys.executable, "-m", "zkv", "tier", "clean"], capture_output=True, text=True, env=env
        )
        assert refused.returncode == 2 and "--bus ID" in refused.stderr and "--all" in refused.stderr, refused.stderr
        dry = zkv("clean", "--bus", bus, "--dry-run")
        assert "1 orphaned CPU tier(s) would be removed" in dry and "nothing removed" in dry, dry
        assert "1 kept for a restart (--with-kept removes them too)" in dry, dry
        assert len(list(list_tiers(str(tier_dir)))) == 3, "a dry run removes nothing"
        assert "1 orphaned CPU tier(s) removed" in zkv("clean", "--all")
        assert sorted(t.rank for t in list_tiers(str(tier_dir))) == [0, 1], "the orphan went, the kept tier stayed"
        assert "1 orphaned CPU tier(s) removed" in zkv("clean", "--bus", bus, "--with-kept")
        assert [t.rank for t in list_tiers(str(tier_dir))] == [0], "a live worker's tier is never removed"
    finally:
        c.stop()
    assert list(list_tiers(str(tier_dir))) == []


def test_an_attached_worker_killed_after_swap_out_maps_its_cpu_tier_again_and_serves_the_exact_blocks(
    tmp_path, tier_dir
):
    """``zkv worker --attach`` keeps its CPU tier in a tier file too: a restart
    attached to the same engine memory serves the blocks it swapped out."""
    layout = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=8, block_size=4, kv_heads=2, head_dim=8)
    c = AttachedCluster(1, layout, directory=tmp_path / "z", quiet=True, broker_args=FAST, worker_args=FAST[2:4])
    try:
        c.start(timeout=120)
        src, rows, dst = [3, 4, 5], [0, 1, 7], [12, 13, 14]
        with c.client(request_timeout=15) as client:
            before = c.engines[0].digest(src)
            assert client.run("swap_out", src, rows, timeout=10).ok
            assert [t.rank for t in list_tiers(str(tier_dir)) if t.owned] == [0], "a tier file, held"

            c.kill_worker(0)
            assert c.engines[0].ask("scribble 9") == "ok"  # the engine's memory is no longer what was swapped out
            c.start_worker(0)  # attached to the same engine's manifest
            st = wait_for(
                client,
                lambda s: s.gen == 1 and s.state == "running" and all(r.alive for r in s.ranks),
                "the restarted attached rank",
                timeout=60,
            )
            assert st.cpu_gen == 0 and "CPU blocks kept" in st.gen_reason, st.gen_reason
            back = client.run("swap_in", rows, dst, timeout=10)
            assert back.ok and client.gen == 1 and client.cpu_gen == 0, back.reason
            assert c.engines[0].digest(dst) == before, "the exact bytes"
    finally:
        c.stop()
    assert list(list_tiers(str(tier_dir))) == []
