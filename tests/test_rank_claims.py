"""Two processes that say they are the same rank: the live one keeps it and
the newcomer is refused, naming both; a newcomer whose predecessor is gone
(its connection dropped, or silent through the probe window) takes over."""

import os
import subprocess
import sys

from zkv.broker.core import BrokerConfig, BrokerCore, ToRank, frames_of
from zkv.harness.bus.cluster import LocalCluster, layout_args
from zkv.testing.sim import LAYOUT
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout

CFG = BrokerConfig(world=1, heartbeat_ms=100, liveness_ms=2000)


def ready(pid: int, host: str, session: int = 1) -> list[bytes]:
    return [P.encode("ready", rank=0, world=1, session=session, layout=LAYOUT.to_wire(), gen=0, pid=pid, host=host)]


def to(actions, identity: bytes) -> list:
    return [P.decode(a.frames[0]) for a in frames_of(actions, ToRank) if a.identity == identity]


def claimed_bus():
    core = BrokerCore(CFG)
    assert [m.kind for m in to(core.on_rank(b"live", ready(11, "host-a"), 1.0), b"live")] == ["welcome"]
    acts = core.on_rank(b"newcomer", ready(22, "host-b"), 1.5)
    assert to(acts, b"newcomer") == []  # parked: no welcome yet
    assert [m.kind for m in to(acts, b"live")] == ["hb"]  # the live one is probed
    return core


def test_a_live_rank_keeps_its_number_and_the_claimant_is_refused_naming_both():
    core = claimed_bus()
    gen = core.gen
    acts = core.on_rank(b"live", [P.encode("hb")], 1.55)
    (refused,) = to(acts, b"newcomer")
    assert refused.kind == "refused"
    assert "pid 11 on host-a" in refused.reason and "pid 22 on host-b" in refused.reason
    status = core.status(1.6)
    assert status["ranks"][0]["pid"] == 11 and status["ranks"][0]["alive"]
    assert core.gen == gen and core.counters["rank_deaths"] == 0
    assert core.counters["duplicate_ranks_refused"] == 1


def test_a_claimant_whose_predecessor_lost_its_connection_takes_over_at_once():
    core = claimed_bus()
    acts = core.on_unreachable(b"live", 1.51)
    assert [m.kind for m in to(acts, b"newcomer")] == ["welcome"]
    assert core.status(1.51)["ranks"][0]["pid"] == 22
    assert core.counters["rank_deaths"] == 1


def test_a_claimant_whose_predecessor_stays_silent_takes_over_after_the_window():
    core = claimed_bus()
    assert core.next_deadline(1.5) <= 0.2 + 1e-9  # the loop wakes for the window's end
    assert to(core.on_tick(1.6), b"newcomer") == []
    assert "welcome" in [m.kind for m in to(core.on_tick(1.71), b"newcomer")]
    assert core.status(1.71)["ranks"][0]["pid"] == 22


def test_a_second_worker_with_a_live_rank_number_is_refused_and_nothing_moves():
    layout = CacheLayout(layers=1, gpu_blocks=8, cpu_blocks=8)
    cluster = LocalCluster(2, layout, quiet=True).start()
    try:
        with cluster.client(request_timeout=10) as c:
            before = c.status()
            ep = cluster.endpoints
            dup = subprocess.run(
                [sys.executable, "-m", "zkv", "worker", "--rank", "1", "--world-size", "2"]
                + ["--backend", ep.backend, "--control", ep.control, *layout_args(layout)]
                + ["--tier-dir", "none"],  # as from another host: on this one its CPU tier file is refused first
                capture_output=True,
                text=True,
                timeout=60,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
            assert dup.returncode == 1, dup.stderr
            live_pid = cluster.workers[1].pid
            assert f"rank 1 is served by a live process (pid {live_pid} on " in dup.stderr
            assert "Traceback" not in dup.stderr
            after = c.status()
            assert after.gen == before.gen and after.counters.get("rank_deaths", 0) == 0
            assert [r.pid for r in after.ranks] == [r.pid for r in before.ranks]
            assert after.counters["duplicate_ranks_refused"] == 1
            assert c.run("swap_out", [1], [1], timeout=10).ok
    finally:
        cluster.stop()
