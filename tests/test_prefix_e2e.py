"""The prefix cache manager on the real bus: a broker and 2 ranks as processes
(each with a disk tier in a temp dir), the real Client as the manager's bus,
block contents checked with per-rank digests (``fill`` writes known bits,
``checksum`` reads them back)."""

from __future__ import annotations

import signal

import pytest
from profiles import long_e2e
from waits import wait_for

from zkv.cycle.prefix import drain_and_clear, pause_clear_resume, resume
from zkv.harness.bus.cluster import LocalCluster
from zkv.harness.prefix.workload import ChatSpec, ChatWorkload, serve_workload
from zkv.prefix import OutOfGpuBlocksError, PrefixCacheManager
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=32, cpu_blocks=64, block_size=16, kv_heads=2, head_dim=32)
BS = LAYOUT.block_size
DISK_BLOCKS = 64  # each rank's disk tier (--disk-blocks)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # A long liveness window: a rank stopped with SIGSTOP for a moment is slow, not dead.
    disk = ["--disk-dir", str(tmp_path_factory.mktemp("disk")), "--disk-blocks", str(DISK_BLOCKS)]
    c = LocalCluster(
        2,
        LAYOUT,
        quiet=True,
        broker_args=["--heartbeat-ms", "100", "--liveness-ms", "10000"],
        worker_args=["--liveness-ms", "10000", *disk],
    ).start(timeout=60)
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    with cluster.client(request_timeout=10) as c:
        yield c


def manager_for(client, **kwargs) -> PrefixCacheManager:
    return PrefixCacheManager(client, BS, LAYOUT.gpu_blocks, LAYOUT.cpu_blocks, swap_timeout=10.0, **kwargs)


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BS)]


def digests(client, block_ids, tier="gpu"):
    out = client.run("checksum", block_ids, timeout=10, tier=tier)
    assert out.ok, out
    return {rank: res["digests"] for rank, res in out.per_rank.items()}


def compute(client, manager, tokens, seed):
    """match + allocate + "forward pass" (fill) + insert + release; returns the inserted block ids."""
    cached = manager.match(tokens)
    fresh = manager.allocate(len(tokens) // BS - cached.num_blocks)
    if fresh.block_ids:
        assert client.run("fill", None, fresh.block_ids, timeout=10, tier="gpu", seed=seed).ok
    ids = cached.block_ids + fresh.block_ids
    manager.insert(tokens, ids)
    manager.release(cached)
    manager.release(fresh)
    return ids


def assert_consistent(manager):
    manager.check_invariants()
    stats = manager.stats()
    for tier in ("gpu", "cpu", "disk"):
        assert stats[tier]["free"] + stats[tier]["used"] == stats[tier]["total"]


def test_a_prefix_pushed_to_the_cpu_comes_back_bit_identical_on_every_rank(client):
    manager = manager_for(client)
    a = prompt(1, 4)
    a_ids = compute(client, manager, a, seed=101)
    original = digests(client, a_ids)
    assert set(original) == {0, 1} and original[0] != original[1], "each rank holds its own shard"

    for seed in range(2, 10):  # 8 more prompts of 4 blocks: 36 blocks > 32 on the GPU
        compute(client, manager, prompt(seed, 4), seed=100 + seed)
    assert manager.locate(a) == ["cpu"] * 4
    stats = manager.stats()
    assert stats["swaps"]["swap_out"]["ok"] >= 1 and stats["swapped_out_blocks"] >= 4
    assert stats["blocks"]["ON_CPU"] >= 4
    assert digests(client, a_ids) != original, "A's old GPU blocks hold other prompts now"

    lease = manager.match(a)
    assert lease.num_blocks == 4 and lease.cpu_hit_blocks == 4 and lease.gpu_hit_blocks == 0
    assert digests(client, lease.block_ids) == original
    assert manager.locate(a) == ["gpu"] * 4
    manager.release(lease)
    again = manager.match(a)
    assert again.gpu_hit_blocks == 4 and digests(client, again.block_ids) == original
    manager.release(again)
    swap_in = manager.stats()["swaps"]["swap_in"]
    assert (swap_in["issued"], swap_in["ok"], swap_in["blocks"]) == (1, 1, 4)
    assert swap_in["bytes"] == 2 * 4 * LAYOUT.block_bytes  # 4 blocks on each of 2 ranks
    assert_consistent(manager)


def dropped(manager) -> int:
    stats = manager.stats()
    return sum(stats[f"dropped_{tier}_blocks"] for tier in ("gpu", "cpu", "disk"))


def test_a_workload_bigger_than_gpu_and_cpu_comes_back_from_the_disk_bit_identical(client):
    manager = manager_for(client, num_disk_blocks=DISK_BLOCKS)
    prompts = [prompt(200 + n, 4) for n in range(36)]  # 144 blocks: more than 32 + 64, fewer than 32 + 64 + 64
    original = {}
    for n, tokens in enumerate(prompts):
        original[n] = digests(client, compute(client, manager, tokens, seed=300 + n))
    stats = manager.stats()
    assert manager.locate(prompts[0]) == ["disk"] * 4, "the oldest went GPU -> CPU -> disk"
    assert stats["spilled_blocks"] >= 48 and stats["disk"]["used"] >= 48
    assert dropped(manager) == 0, "nothing dropped while the disk had room"
    for n in (0, 1, 2):
        lease = manager.match(prompts[n])
        assert (lease.num_blocks, lease.disk_hit_blocks) == (4, 4)
        assert digests(client, lease.block_ids) == original[n], "loaded and swapped in bit for bit, on every rank"
        manager.release(lease)
    stats = manager.stats()
    assert stats["swaps"]["load"]["ok"] >= 1 and stats["loaded_blocks"] == 12 and stats["disk_hit_rate"] > 0
    assert stats["swaps"]["spill"]["issued"] == stats["swaps"]["spill"]["ok"]
    assert_consistent(manager)

    for n in range(36, 60):  # 96 blocks more: the disk fills, and only then are blocks dropped
        compute(client, manager, prompt(200 + n, 4), seed=300 + n)
        stats = manager.stats()
        assert dropped(manager) == 0 or stats["disk"]["peak_used"] == DISK_BLOCKS, f"dropped early ({n})"
    assert manager.stats()["dropped_disk_blocks"] > 0
    assert_consistent(manager)


@long_e2e(
    "a cluster of its own, one rank killed and restarted, 10-20 s",
    "tests/test_prefix_generations.py (the manager) with tests/test_cpu_tier_restart_e2e.py (the bus)",
)
def test_a_rank_restart_that_keeps_its_cpu_tier_costs_the_manager_only_its_gpu_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("ZKV_TIER_DIR", str(tmp_path / "tiers"))  # the workers and LocalCluster.stop read it
    disk = ["--disk-dir", str(tmp_path / "disk"), "--disk-blocks", str(DISK_BLOCKS)]
    fast = ["--heartbeat-ms", "100", "--liveness-ms", "1000", "--op-timeout-ms", "10000"]
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=fast, worker_args=["--liveness-ms", "1000", *disk])
    try:
        c.start(timeout=60)
        with c.client(request_timeout=15) as client:
            manager = PrefixCacheManager(client, BS, LAYOUT.gpu_blocks, 4, swap_timeout=10.0, num_disk_blocks=8)
            on_disk, on_cpu, on_gpu = prompt(400, 4), prompt(401, 4), prompt(402, 4)
            original = {}
            for tokens in (on_disk, on_cpu, on_gpu):
                original[tokens[0]] = digests(client, compute(client, manager, tokens, seed=tokens[0] % 1000))
                if tokens is not on_gpu:
                    assert manager.evict(4) == 4  # on_disk to the CPU, then on_cpu there and on_disk below
            assert [manager.locate(t)[0] for t in (on_disk, on_cpu, on_gpu)] == ["disk", "cpu", "gpu"]

            c.kill_worker(1)  # SIGKILL: its CPU tier file and disk file stay for the next process
            c.start_worker(1)
            st = wait_for(client, lambda s: s.gen == 1 and all(r.alive for r in s.ranks), "the restart")
            assert st.cpu_gen == 0 and client.gen == 1, "the GPU generation moved alone"

            assert manager.match(on_gpu).num_blocks == 0 and manager.locate(on_gpu) == []
            for tokens, tier in ((on_cpu, "cpu"), (on_disk, "disk")):
                lease = manager.match(tokens)
                assert getattr(lease, f"{tier}_hit_blocks") == 4, f"the {tier} entries survived the restart"
                assert digests(client, lease.block_ids) == original[tokens[0]], "bit for bit, on every rank"
                manager.release(lease)
            stats = manager.stats()
            assert (stats["gpu_generation_drops"], stats["generation_resets"]) == (1, 0)
            assert_consistent(manager)
    finally:
        c.stop()


def test_pause_clear_resume_in_the_middle_of_a_workload(client):
    manager = manager_for(client)
    workload = ChatWorkload(BS, ChatSpec.for_cache(LAYOUT.gpu_blocks), seed=3)
    first = serve_workload(client, manager, 30, workload=workload)
    assert first.ok, first.errors
    assert first.manager["swaps"]["swap_out"]["ok"] > 0, "the workload must put the GPU under pressure"

    tokens = prompt(50, 3)
    held = manager.match(tokens), manager.allocate(3)  # a request in flight across the cycle
    busy = [client.submit("checksum", list(range(8)), None, 10, tier="cpu") for _ in range(8)]  # tasks to drain
    info = pause_clear_resume(client, manager)
    assert info["pause"].state == "paused" and info["clear"].state == "cleared"
    assert info["resume"].state == "running" and info["layout"].gpu_blocks == LAYOUT.gpu_blocks
    assert {client.wait(task, timeout=10).outcome for task in busy} <= {"ok", "cancelled"}
    for lease in held:
        manager.release(lease)  # from before the clear: a no-op
    assert manager.stats()["gpu"] == {"total": 32, "used": 0, "free": 32, "peak_used": 0, "reserved": 0}
    assert_consistent(manager)

    second = serve_workload(client, manager, 30, workload=workload)
    assert second.ok, second.errors
    assert second.verified_hit_blocks > 0
    ids = compute(client, manager, tokens, seed=7)
    lease = manager.match(tokens)
    assert lease.gpu_hit_blocks == 3 and lease.block_ids == ids
    manager.release(lease)
    assert_consistent(manager)


def test_a_workload_with_a_cycle_that_resumes_on_more_gpu_blocks(client):
    manager = manager_for(client)
    try:
        report = serve_workload(
            client,
            manager,
            40,
            workload=ChatWorkload(BS, ChatSpec.for_cache(32), seed=5),
            cycle_at=20,
            cycle_layout={"gpu_blocks": 48},
        )
        assert report.ok, report.errors
        assert len(report.cycles) == 1 and report.cycles[0]["layout"].gpu_blocks == 48
        assert report.manager["gpu"]["total"] == 48 and report.manager["cpu"]["total"] == LAYOUT.cpu_blocks
        gpu_after, cpu_after = report.hit_rates_since_cycle()
        assert gpu_after > 0, "hits again after the resume"
        assert client.status().layout.gpu_blocks == 48
        ids = compute(client, manager, prompt(60, 2), seed=9)
        assert max(ids) < 48
        assert_consistent(manager)
    finally:
        drain_and_clear(client, manager)
        resume(client, manager, {"gpu_blocks": LAYOUT.gpu_blocks})
    assert manager.stats()["gpu"]["total"] == LAYOUT.gpu_blocks and client.status().layout == LAYOUT


def barrier(client):
    """A task behind everything already sent: each rank runs tasks in order and pushes
    results to us in order, so once it is back every earlier result is filed."""
    assert client.run("checksum", [0], timeout=10, tier="cpu").ok


@pytest.mark.parametrize("op", ["swap_in", "swap_out"])
def test_a_swap_that_times_out_on_a_stopped_rank_is_rolled_back_and_released_late(cluster, client, op):
    manager = manager_for(client)
    tokens = prompt(70, 4)
    ids = compute(client, manager, tokens, seed=11)
    original = digests(client, ids)
    if op == "swap_in":
        assert manager.evict(4) == 4 and manager.locate(tokens) == ["cpu"] * 4
    manager.swap_timeout = 0.5
    worker = cluster.workers[1]
    worker.send_signal(signal.SIGSTOP)
    try:
        if op == "swap_in":
            lease = manager.match(tokens)
            assert lease.num_blocks == 0, "the swap-in timed out: no hit"
            manager.release(lease)
            assert manager.locate(tokens) == ["cpu"] * 4, "the blocks stay on the CPU"
            quarantined = {"gpu": 4, "cpu": 0, "disk": 0}
        else:
            assert manager.evict(4) == 4
            assert manager.locate(tokens) == [], "the victims are dropped"
            quarantined = {"gpu": 0, "cpu": 4, "disk": 0}
        stats = manager.stats()
        assert stats["swaps"][op]["timeout"] == 1 and stats["quarantined_blocks"] == quarantined
        assert_consistent(manager)
        if op == "swap_in":
            with pytest.raises(OutOfGpuBlocksError, match="4 quarantined"):
                manager.allocate(29)  # 28 free, 4 behind the timed-out swap
        assert client.settled() == []  # nothing settles while the rank is stopped
    finally:
        worker.send_signal(signal.SIGCONT)
    barrier(client)  # the stopped rank has caught up: its late result for the swap is in
    assert manager.reclaim_quarantine() == 4
    stats = manager.stats()
    assert stats["quarantined_blocks"] == {"gpu": 0, "cpu": 0, "disk": 0} and stats["late_outcomes"] == 1
    assert stats["gpu"]["used"] == 0 and stats["cpu"]["used"] == (4 if op == "swap_in" else 0)
    assert_consistent(manager)

    manager.swap_timeout = 10.0
    if op == "swap_in":
        lease = manager.match(tokens)  # retried on a healthy bus
        assert lease.cpu_hit_blocks == 4
        assert digests(client, lease.block_ids) == original
        manager.release(lease)
    else:
        fresh = manager.allocate(32)  # every GPU block is usable again
        manager.release(fresh)
    assert_consistent(manager)


def test_the_manager_reclaims_on_its_own_at_the_next_match(cluster, client):
    manager = manager_for(client)
    tokens = prompt(80, 2)
    compute(client, manager, tokens, seed=13)
    assert manager.evict(2) == 2
    manager.swap_timeout = 0.5
    cluster.workers[0].send_signal(signal.SIGSTOP)
    try:
        assert manager.match(tokens).num_blocks == 0
    finally:
        cluster.workers[0].send_signal(signal.SIGCONT)
    assert manager.stats()["quarantined_blocks"]["gpu"] == 2
    barrier(client)
    manager.swap_timeout = 10.0
    lease = manager.match(tokens)  # reclaims first, then swaps in
    assert lease.cpu_hit_blocks == 2
    assert manager.stats()["quarantined_blocks"]["gpu"] == 0 and manager.stats()["reclaimed_blocks"] == 2
    manager.release(lease)
    assert_consistent(manager)


class ReversedSwapIn:
    """A broken bus in front of the real one: swap-ins land in the wrong order."""

    def __init__(self, client):
        self.client = client

    def submit(self, op, src, dst, timeout=30.0):
        if op == "swap_in" and len(dst) > 1:
            dst = list(reversed(dst))
        return self.client.submit(op, src, dst, timeout)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_the_workload_check_catches_blocks_that_come_back_wrong(client):
    manager = PrefixCacheManager(ReversedSwapIn(client), BS, LAYOUT.gpu_blocks, LAYOUT.cpu_blocks, swap_timeout=10.0)
    report = serve_workload(client, manager, 40, workload=ChatWorkload(BS, ChatSpec.for_cache(32), seed=3))
    assert manager.stats()["swaps"]["swap_in"]["ok"] > 0
    assert not report.ok and any("swapped back from the CPU" in e for e in report.errors), report.errors


def test_the_demo_runs_against_a_cluster_and_says_what_it_did(cluster):
    from zkv.harness.prefix.demo import run_demo

    lines: list[str] = []
    ok = run_demo(cluster.endpoints.frontend, LAYOUT, 40, echo=lines.append, disk_blocks=DISK_BLOCKS)
    text = "\n".join(lines)
    assert ok, text
    for expected in (
        "round trip of 32 blocks on 2 ranks: bit-identical",
        "through the disk tier: bit-identical",
        "with the disk tier: 20/20 requests",
        "without a disk tier: 20/20 requests",
        "requests/s",
        "hit rate over",
        "disk ",
        "swap_out:",
        "swap_in:",
        "spill:",
        "load:",
        "dropped for want of room: 0 GPU, 0 CPU, 0 disk blocks; the disk tier peaked at",
        "pause/clear/resume",
        "with vs without the disk tier:",
        "all bit-identical",
    ):
        assert expected in text, text
    assert "ERROR" not in text


def test_the_demo_says_why_a_disk_tier_serves_fewer_requests_a_second_when_it_does():
    from zkv.harness.prefix.demo import why_disk_slower

    slower = {"requests_per_s": 21.0, "computed_blocks": 1107}
    faster = {"requests_per_s": 24.0, "computed_blocks": 1325}
    said = why_disk_slower(slower, faster)
    assert said is not None and "runs no model" in said and "saved 218 block computations" in said, said
    assert why_disk_slower(faster | {"computed_blocks": 1107}, slower | {"computed_blocks": 1325}) is None
