"""``zkv up`` as a supervisor: a rank killed with kill -9 is started again and
serves (the bus keeps its layout, a resume's included); ``zkv down`` stops a
running one from another terminal; a ``zkv up`` killed with kill -9 leaves no
broker or rank behind, and the next ``zkv up`` in that directory starts
(docs/operations.md, "Starting, restarting, and a broker that does not answer")."""

from __future__ import annotations

import os
import select
import signal
from pathlib import Path

from profiles import long_e2e
from test_operator_paths import LAYOUT, Up, cli, zkv
from test_worker_paths import Lines
from waits import wait_for

from zkv.client.client import Client


def gone(pid: int, timeout: float) -> bool:
    """Wait (bounded, on a pidfd) until ``pid`` exits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(int(timeout * 1000)))
    finally:
        os.close(fd)


def pids(broker: str) -> dict[int, int]:
    with Client(broker) as c:
        return {r.rank: r.pid for r in c.status().ranks}


def stopped_from_another_terminal(bus: Up, runtime_dir: Path) -> None:
    """A second zkv up in ``runtime_dir`` is refused naming zkv down, which stops ``bus`` (exit 0);
    a zkv down after that says none is running."""
    second = zkv("up", "--runtime-dir", str(runtime_dir), "--ranks", "2", timeout=60)
    assert second.returncode == 1 and f"zkv down --runtime-dir {runtime_dir}" in second.stderr, second.stderr
    down = zkv("down", "--runtime-dir", str(runtime_dir), timeout=60)
    assert down.returncode == 0 and "stopped zkv up" in down.stdout, down.stdout + down.stderr
    assert bus.proc.wait(timeout=30) == 0
    again = zkv("down", "--runtime-dir", str(runtime_dir), timeout=60)
    assert again.returncode == 1 and "no zkv up is running" in again.stderr


@long_e2e(
    "a zkv up of its own, a rank killed and started again, 10-20 s",
    "test_a_rank_restarted_after_a_new_layout_comes_back_on_it_and_keeps_its_cpu_blocks (zkv down included)",
)
def test_a_killed_rank_is_started_again_and_zkv_down_stops_the_bus(tmp_path):
    bus = Up(tmp_path, "--ranks", "2", "--fresh", "--gpu-blocks", "32", *LAYOUT)
    try:
        said = bus.wait_for("Ctrl-C to stop.")
        assert f"zkv down --runtime-dir {tmp_path}" in said
        b = ["--broker", bus.broker]
        assert cli("pause", *b).returncode == 0 and cli("clear", *b).returncode == 0
        assert cli("resume", "--gpu-blocks", "48", *b).returncode == 0  # the bus's layout is no longer the flags'
        before = pids(bus.broker)
        os.kill(before[1], signal.SIGKILL)
        bus.wait_for("zkv up: rank 1 exited with code -9; starting it again")
        with Client(bus.broker) as c:
            st = wait_for(
                c,
                lambda st: (
                    {r.rank: (r.pid, r.alive) for r in st.ranks}.get(1, (0, False))[1]
                    and next(r.pid for r in st.ranks if r.rank == 1) != before[1]
                    and st.state == "running"
                ),
                "rank 1 to come back",
                timeout=60,
            )
            assert st.layout.gpu_blocks == 48
            assert c.run("fill", dst=[47], tier="gpu", seed=1, timeout=30).ok, "the restarted rank serves at 48 blocks"
        stopped_from_another_terminal(bus, tmp_path)
    finally:
        if bus.proc.poll() is None:
            bus.stop()


@long_e2e(
    "two zkv ups of their own, 12-25 s",
    "tests/test_cluster_lifeline.py (a cluster's owner killed with kill -9 leaves no bus process)",
)
def test_a_zkv_up_killed_with_kill_9_leaves_no_process_and_the_next_one_starts(tmp_path):
    bus = Up(tmp_path, "--ranks", "2", "--fresh", "--gpu-blocks", "32", *LAYOUT)
    try:
        bus.wait_for("Ctrl-C to stop.")
        ranks = pids(bus.broker)
        broker = int((tmp_path / "broker.lock").read_text())
        bus.proc.kill()
        bus.proc.wait(timeout=30)
        assert gone(broker, 30), "the broker outlived its zkv up"
        assert all(gone(pid, 30) for pid in ranks.values()), "a rank outlived its zkv up"
    finally:
        if bus.proc.poll() is None:
            bus.proc.kill()
    again = Up(tmp_path, "--ranks", "2", "--gpu-blocks", "32", *LAYOUT)
    try:
        again.wait_for("Ctrl-C to stop.")
        assert cli("submit", "fill", "--dst", "1", "--broker", again.broker).returncode == 0
    finally:
        again.stop()


@long_e2e(
    "a zkv up and a standby worker of their own, 12-25 s",
    "test_the_standby_zkv_up_starts_after_a_takeover_comes_back_on_the_new_layout_and_keeps_the_cpu_blocks",
)
def test_a_standby_beside_a_zkv_up_rank_takes_it_over_and_zkv_up_keeps_the_bus_and_stands_by_in_turn(tmp_path):
    import subprocess
    import sys

    from zkv.net.endpoints import Endpoints

    tiers = str(tmp_path / "tiers")
    bus = Up(tmp_path, "--ranks", "2", "--fresh", "--gpu-blocks", "32", *LAYOUT, "--tier-dir", tiers)
    standby = None
    try:
        bus.wait_for("Ctrl-C to stop.")
        ep = Endpoints.in_dir(tmp_path)
        standby = subprocess.Popen(
            [sys.executable, "-m", "zkv", "worker", "--rank", "1", "--world-size", "2", "--backend", ep.backend]
            + ["--control", ep.control, "--tier-dir", tiers, "--standby", "--gpu-blocks", "32", *LAYOUT],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        Lines(standby).wait_for("taking over when it exits")  # waiting on the rank's lock
        before = pids(bus.broker)
        with Client(bus.broker) as c:
            os.kill(before[1], signal.SIGKILL)
            bus.wait_for(f"pid {standby.pid} serves it now (a standby took over): starting it again as that")

            def rank1_is(want) -> bool:
                return lambda st: (
                    st.state == "running" and any(r.rank == 1 and r.alive and want(r.pid) for r in st.ranks)
                )

            wait_for(c, rank1_is(lambda pid: pid == standby.pid), "the standby to serve rank 1", timeout=60)
            assert c.run("fill", dst=[3], tier="gpu", seed=1, timeout=30).ok, "the bus serves"
            os.kill(standby.pid, signal.SIGKILL)  # the standby zkv up started in turn takes over
            standby.wait(timeout=30)
            mine = (before[1], standby.pid)
            wait_for(c, rank1_is(lambda pid: pid not in mine), "zkv up's standby to serve rank 1", timeout=60)
            assert c.run("fill", dst=[4], tier="gpu", seed=1, timeout=30).ok
        assert bus.proc.poll() is None, "zkv up kept the bus"
        assert "exited 6 times" not in bus.output() and "refused" not in bus.output()
    finally:
        if standby is not None and standby.poll() is None:
            standby.kill()
            standby.wait(timeout=30)
        if bus.proc.poll() is None:
            bus.stop()


def test_zkv_up_restarts_a_worker_attached_to_an_engine_as_it_is(tmp_path):
    """An attached worker's layout is its engine's memory: no --adopt-layout (refused with --attach), no layout
    asked of the bus."""
    from zkv.cli.supervise import _restart
    from zkv.harness.bus.attached_cluster import AttachedCluster

    started = []

    class Recorded(AttachedCluster):
        def start_worker(self, rank, extra=(), layout=None):
            started.append((rank, list(extra), layout))

    _restart(Recorded(1, directory=tmp_path / "attached"), 0, ["--standby"])
    assert started == [(0, ["--standby"], None)]


def test_a_rank_restarted_after_a_new_layout_comes_back_on_it_and_keeps_its_cpu_blocks(tmp_path):
    """pause, clear, resume --cpu-blocks 32 (not the start flags' 64), swap out, kill -9 rank 1: zkv up starts
    it on the bus's layout, so it maps its tier file again and a swap-in brings the exact bytes back.  A second
    zkv up in that directory is refused naming zkv down, which stops the running one from another terminal."""
    tiers = str(tmp_path / "tiers")
    bus = Up(tmp_path, "--ranks", "2", "--fresh", "--gpu-blocks", "32", *LAYOUT, "--tier-dir", tiers)
    try:
        said = bus.wait_for("Ctrl-C to stop.")
        assert f"zkv down --runtime-dir {tmp_path}" in said
        b = ["--broker", bus.broker]
        for step in (["pause"], ["clear"], ["resume", "--cpu-blocks", "32"]):
            assert cli(*step, *b).returncode == 0, step
        with Client(bus.broker) as c:
            assert c.run("fill", dst=[0, 1, 2, 3], tier="gpu", seed=7, timeout=30).ok
            want = c.run("checksum", [0, 1, 2, 3], tier="gpu", timeout=30)
            assert c.run("swap_out", [0, 1, 2, 3], [10, 11, 12, 13], timeout=30).ok
            before = pids(bus.broker)
            os.kill(before[1], signal.SIGKILL)
            bus.wait_for("zkv up: rank 1 exited with code -9; starting it again")

            def back_up(st) -> bool:
                return st.state == "running" and any(r.rank == 1 and r.alive and r.pid != before[1] for r in st.ranks)

            st = wait_for(c, back_up, "rank 1 to come back", timeout=60)
            assert st.layout.cpu_blocks == 32
            assert "CPU blocks kept" in st.gen_reason, st.gen_reason
            back = c.run("swap_in", [10, 11, 12, 13], [20, 21, 22, 23], timeout=30)
            assert back.ok, back.reason
            got = c.run("checksum", [20, 21, 22, 23], tier="gpu", timeout=30)
            for r in (0, 1):
                assert got.per_rank[r]["digests"] == want.per_rank[r]["digests"], f"rank {r}: the exact bytes back"
        assert "adopts the bus's layout" not in bus.output(), "the restarted rank came back on the bus's layout"
        stopped_from_another_terminal(bus, tmp_path)
    finally:
        if bus.proc.poll() is None:
            bus.stop()


def test_the_standby_zkv_up_starts_after_a_takeover_comes_back_on_the_new_layout_and_keeps_the_cpu_blocks(tmp_path):
    """After a new layout, a standby (started by hand on it) takes rank 1 over; the worker zkv up then starts as
    its standby is on the bus's layout too, so when it takes over in turn the CPU blocks are still there; the bus
    serves throughout and zkv up keeps it."""
    import subprocess
    import sys

    from zkv.net.endpoints import Endpoints

    tiers = str(tmp_path / "tiers")
    bus = Up(tmp_path, "--ranks", "2", "--fresh", "--gpu-blocks", "32", *LAYOUT, "--tier-dir", tiers)
    standby = None
    try:
        bus.wait_for("Ctrl-C to stop.")
        b = ["--broker", bus.broker]
        for step in (["pause"], ["clear"], ["resume", "--cpu-blocks", "32"]):
            assert cli(*step, *b).returncode == 0, step
        ep = Endpoints.in_dir(tmp_path)
        new_layout = [*LAYOUT, "--cpu-blocks", "32"]  # the last --cpu-blocks counts
        standby = subprocess.Popen(
            [sys.executable, "-m", "zkv", "worker", "--rank", "1", "--world-size", "2", "--backend", ep.backend]
            + ["--control", ep.control, "--tier-dir", tiers, "--standby", "--gpu-blocks", "32", *new_layout],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        Lines(standby).wait_for("taking over when it exits")
        with Client(bus.broker) as c:
            assert c.run("fill", dst=[0, 1, 2, 3], tier="gpu", seed=9, timeout=30).ok
            want = c.run("checksum", [0, 1, 2, 3], tier="gpu", timeout=30)
            assert c.run("swap_out", [0, 1, 2, 3], [10, 11, 12, 13], timeout=30).ok
            before = pids(bus.broker)
            os.kill(before[1], signal.SIGKILL)
            bus.wait_for(f"pid {standby.pid} serves it now (a standby took over): starting it again as that")

            def rank1_is(want_pid) -> bool:
                return lambda st: (
                    st.state == "running" and any(r.rank == 1 and r.alive and want_pid(r.pid) for r in st.ranks)
                )

            wait_for(c, rank1_is(lambda pid: pid == standby.pid), "the standby to serve rank 1", timeout=60)
            assert c.run("fill", dst=[3], tier="gpu", seed=1, timeout=30).ok, "the bus serves"
            os.kill(standby.pid, signal.SIGKILL)  # zkv up's standby takes over in turn
            standby.wait(timeout=30)
            mine = (before[1], standby.pid)
            st = wait_for(c, rank1_is(lambda pid: pid not in mine), "zkv up's standby to serve rank 1", timeout=60)
            assert "CPU blocks kept" in st.gen_reason, st.gen_reason
            back = c.run("swap_in", [10, 11, 12, 13], [20, 21, 22, 23], timeout=30)
            assert back.ok, back.reason
            got = c.run("checksum", [20, 21, 22, 23], tier="gpu", timeout=30)
            assert got.per_rank[1]["digests"] == want.per_rank[1]["digests"], "rank 1: the exact bytes back"
        assert bus.proc.poll() is None, "zkv up kept the bus"
        assert "exited 6 times" not in bus.output() and "refused" not in bus.output()
    finally:
        if standby is not None and standby.poll() is None:
            standby.kill()
            standby.wait(timeout=30)
        if bus.proc.poll() is None:
            bus.stop()
