"""``zkv up`` as a supervisor: a rank killed with kill -9 is started again and
serves (the bus keeps its layout, a resume's included); ``zkv down`` stops a
running one from another terminal; a ``zkv up`` killed with kill -9 leaves no
broker or rank behind, and the next ``zkv up`` in that directory starts
(docs/operations.md, "Starting, restarting, and a broker that does not answer")."""

from __future__ import annotations

import os
import select
import signal

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
        second = zkv("up", "--runtime-dir", str(tmp_path), "--ranks", "2", timeout=60)
        assert second.returncode == 1 and f"zkv down --runtime-dir {tmp_path}" in second.stderr, second.stderr

        down = zkv("down", "--runtime-dir", str(tmp_path), timeout=60)
        assert down.returncode == 0 and "stopped zkv up" in down.stdout, down.stdout + down.stderr
        assert bus.proc.wait(timeout=30) == 0
        again = zkv("down", "--runtime-dir", str(tmp_path), timeout=60)
        assert again.returncode == 1 and "no zkv up is running" in again.stderr
    finally:
        if bus.proc.poll() is None:
            bus.stop()


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


def test_zkv_up_restarts_a_worker_of_its_own_memory_adopting_the_bus_layout_and_an_attached_one_as_it_is(tmp_path):
    from zkv.cli.supervise import _adopt
    from zkv.harness.bus.attached_cluster import AttachedCluster
    from zkv.harness.bus.cluster import LocalCluster

    assert _adopt(LocalCluster(1, directory=tmp_path / "own")) == ["--adopt-layout"]
    assert _adopt(AttachedCluster(1, directory=tmp_path / "attached")) == [], "--attach refuses --adopt-layout"
