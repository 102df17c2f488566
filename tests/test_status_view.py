"""The readable ``zkv status`` view, on status replies of a real cluster and
of a rank attached to an engine's own tensor (its blocks and bytes per block)."""

from __future__ import annotations

import io
import threading
import time

import pytest
import torch

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.client.client import Client, ZkvError
from zkv.harness.bus.cluster import LocalCluster
from zkv.net.endpoints import Endpoints
from zkv.obs.fleet_view import render_fleet_status
from zkv.obs.status_view import counted, human_age, human_bytes, render_status, watch_status
from zkv.rank.agent import RankAgent
from zkv.rank.memory.regions import TensorEntry
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=32, cpu_blocks=64, block_size=4, kv_heads=2, head_dim=8)


def rank_row(text: str, rank: int) -> list[str]:
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] == str(rank) and len(cells) > 3:
            return cells
    raise AssertionError(f"no row for rank {rank} in:\n{text}")


def tier_row(text: str, tier: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == [tier]]
    assert len(rows) == 1, text
    return rows[0]


def test_table_from_a_real_cluster_alive_paused_and_dead():
    with (
        LocalCluster(2, LAYOUT, quiet=True, broker_args=["--liveness-ms", "600", "--heartbeat-ms", "100"]) as cluster,
        cluster.client() as client,
    ):
        for i in range(3):
            assert client.run("swap_out", [i], [i], timeout=30).ok
        client.pause(timeout=30)  # the acks bring every rank's fresh stats
        paused = client.status(timeout=10)
        text = render_status(paused.as_dict())
        assert text.splitlines()[0].startswith("bus PAUSED")
        assert f"epoch {paused.epoch}" in text and f"generation {paused.gen}" in text
        for rank in (0, 1):
            row = rank_row(text, rank)
            assert row[1] == "yes"
            assert "3" in row  # tasks ok
            assert human_bytes(3 * LAYOUT.block_bytes) in text
        assert LAYOUT.block_bytes == 512
        assert tier_row(text, "gpu") == ["gpu", "32", "512", *human_bytes(32 * 512).split()]
        assert tier_row(text, "cpu")[:2] == ["cpu", "64"]
        client.resume(timeout=30)

        cluster.kill_worker(1)
        with pytest.raises(ZkvError) as err:
            client.pause(timeout=20)  # fails when the broker declares rank 1 dead
        assert err.value.code == "rank_dead"
        text = render_status(client.status(timeout=10).as_dict())
        assert rank_row(text, 1)[1] == "DEAD" and rank_row(text, 0)[1] == "yes"
        assert "bus RUNNING" in text

        out = io.StringIO()
        n = watch_status(lambda: client.status(timeout=5).as_dict(), out, interval=0.05, iterations=2, clear=False)
        assert n == 2 and out.getvalue().count("zkv status at") == 2 and out.getvalue().count("DEAD") == 2


def test_watch_stops_on_event_and_survives_a_silent_broker():
    def silent():
        raise ZkvError("no_reply", "no reply from the broker within 1 s")

    out = io.StringIO()
    assert watch_status(silent, out, interval=0.01, iterations=2, clear=True) == 2
    assert out.getvalue().count("broker not answering: no reply") == 2
    assert out.getvalue().startswith("\x1b[H\x1b[2J")

    stop = threading.Event()

    def fetch():  # the event is set while the watch waits out its 30 s interval
        threading.Timer(0.1, stop.set).start()
        return silent()

    t0 = time.monotonic()
    assert watch_status(fetch, io.StringIO(), interval=30, stop=stop, clear=False) == 1
    assert time.monotonic() - t0 < 10, "the set event ends the 30 s wait at once"


def test_never_registered_ranks_and_odd_values():
    text = render_status(
        {
            "state": "running",
            "epoch": 0,
            "gen": 0,
            "world": 3,
            "ranks": [
                {
                    "rank": 1,
                    "alive": True,
                    "last_seen_ms": 1500.0,
                    "inflight": 2,
                    "pid": 7,
                    "stats": {"copies_after_ack": 1, "bytes_moved": "x"},
                }
            ],
            "queued": 0,
            "inflight": 0,
            "counters": {"backend_wakeups": 40, "ok": 3, "submitted": 4, "pause_ok": 1, "rank_deaths": 1},
        }
    )
    assert rank_row(text, 0)[1:3] == ["never", "registered"]
    assert rank_row(text, 2)[1:3] == ["never", "registered"]
    assert rank_row(text, 1)[2:4] == ["1.5", "s"]
    assert "WARNING: ranks 1 started copies after acking a pause" in text
    shown = "broker counters: submitted 4, ok 3, pause_ok 1, rank_deaths 1, backend_wakeups 40"
    assert shown in text, "tasks first, the broker loop's own counters last"
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(-1) == "-" and human_bytes(True) == "-"
    assert human_age(None) == "-" and human_age(50) == "50 ms ago"


def test_the_table_says_why_the_generation_moved():
    st = {
        "state": "running",
        "epoch": 3,
        "gen": 2,
        "world": 1,
        "ranks": [],
        "queued": 0,
        "inflight": 0,
        "gen_reason": "a rank restarted with its memory gone",
    }
    assert "generation 2 because a rank restarted with its memory gone" in render_status(st).splitlines()
    assert "because" not in render_status({**st, "gen_reason": ""})


def flat_cache(rows: int, page: int) -> list[TensorEntry]:
    return [TensorEntry("kv", torch.zeros(rows, page, dtype=torch.uint8))]


def test_an_attached_engines_blocks_and_bytes_per_block_are_in_the_table(tmp_path):
    """A rank on an engine tensor of 8 blocks of 24 KiB (no zkv layout has that
    page by default): the table shows the engine's geometry, per tier and per
    rank.  The engine then reallocates 12 blocks of 8 KiB: a resume that names
    only the new block count is refused on the bytes per block, one that names
    the new page size is taken, and the table shows it."""
    endpoints = Endpoints.in_dir(tmp_path)
    broker = Broker(endpoints, BrokerConfig(world=1, heartbeat_ms=100))
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    agent = RankAgent(0, 1, endpoints.backend, endpoints.control, flat_cache(8, 24576), 3)
    try:
        agent.start(timeout=30)
        with Client(endpoints.frontend) as client:
            assert client.run("swap_out", [1, 2], [0, 1], timeout=30).ok
            client.pause(timeout=30)  # the ack brings the rank's stats
            text = render_status(client.status(timeout=10).as_dict())

            client.clear(timeout=30)
            agent.attach(flat_cache(12, 8192))
            with pytest.raises(ZkvError) as err:
                client.resume({"gpu_blocks": 12}, timeout=30)
            assert err.value.code == "alloc_failed" and "has 8192 bytes per block" in err.value.reason
            agent.attach(flat_cache(12, 8192))  # the failed resume rolled back: hand it over again
            new = {"gpu_blocks": 12, "layers": 1, "kv_heads": 1, "block_size": 1, "head_dim": 2048, "dtype": "bf16"}
            client.resume(new, timeout=30)
            resumed = render_status(client.status(timeout=10).as_dict())
    finally:
        agent.stop(timeout=10)
        broker.stop()
        thread.join(timeout=10)
    assert tier_row(text, "gpu") == ["gpu", "8", "24576", "(24.0", "KiB)", "192.0", "KiB"]
    assert "model fields: not announced" in text and "head_dim" not in text, "no made-up model shape"
    assert tier_row(text, "cpu") == ["cpu", "3", "24576", "(24.0", "KiB)", "72.0", "KiB"]
    row = " ".join(rank_row(text, 0))
    assert row.startswith("0 yes") and "48.0 KiB 192.0 KiB 72.0 KiB" in row, "bytes moved (2 blocks), gpu and cpu cache"
    assert tier_row(resumed, "gpu") == ["gpu", "12", "8192", "(8.0", "KiB)", "96.0", "KiB"]
    assert "bus RUNNING" in resumed


def test_a_saved_layout_zkv_cannot_read_shows_dashes():
    text = render_status({"state": "running", "layout": {"gpu_blocks": 8, "layers": "x"}, "ranks": []})
    assert tier_row(text, "gpu") == ["gpu", "8", "-", "-"]
    assert tier_row(text, "cpu") == ["cpu", "-", "-", "-"]
    assert "model fields: x layers, - kv heads" in text


def test_counts_agree_with_their_nouns():
    assert [counted(n, "bus") for n in (0, 1, 2)] == ["0 buses", "1 bus", "2 buses"]
    assert [counted(n, "rank") for n in (1, 3)] == ["1 rank", "3 ranks"]
    assert counted(2, "engine process") == "2 engine processes"
    one = [{"bus": "a", "broker": "ipc:///x", "ok": True, "state": "running", "ms": 1.0}]
    assert render_fleet_status(one).startswith("fleet of 1 bus: 1 answered")
