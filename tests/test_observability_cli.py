"""Observability through the command line: ``zkv up --metrics-port`` (a real
broker and rank processes) scraped with a real HTTP request and parsed with
prometheus_client's parser, ``zkv status`` as a table and ``--watch``,
``zkv trace plot`` and ``zkv bench --plot`` writing real PNGs."""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from profiles import long_e2e
from scrapes import free_port, scrape, value

from zkv import Client
from zkv.net.endpoints import Endpoints
from zkv.rank.tiers import disk_io
from zkv.rank.tiers.tier_file import HEADER_BYTES, list_tiers

LAYOUT_ARGS = [
    "--layers",
    "2",
    "--gpu-blocks",
    "32",
    "--cpu-blocks",
    "64",
    "--block-size",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "8",
]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # layers x (K, V) x block_size x kv_heads x head_dim x bf16


def zkv(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zkv", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )


DISK_BLOCKS = 96


@pytest.fixture(scope="module")
def tier_dirs(tmp_path_factory):
    """Where the ranks of ``bus`` keep their CPU tier files and disk tier files."""
    base = tmp_path_factory.mktemp("tiers")
    return base / "cpu", base / "disk"


@pytest.fixture(scope="module")
def bus(tmp_path_factory, tier_dirs):
    """``zkv up`` with 2 ranks, a metrics port, CPU tier files (with digests) and
    disk tiers in directories of their own; yields (frontend, metrics url)."""
    directory = tmp_path_factory.mktemp("up")
    port = free_port()
    tiers = ["--tier-dir", str(tier_dirs[0]), "--tier-digests", "--disk-dir", str(tier_dirs[1])]
    proc = subprocess.Popen(
        [sys.executable, "-m", "zkv", "up", "--ranks", "2", "--runtime-dir", str(directory), *LAYOUT_ARGS, *tiers]
        + ["--disk-blocks", str(DISK_BLOCKS)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ZKV_METRICS_PORT": str(port)},
    )  # the env fallback of --metrics-port
    frontend = Endpoints.in_dir(directory).frontend
    try:
        with Client(frontend) as c:
            c.status(timeout=120, wait_ranks=2)
        yield frontend, f"http://127.0.0.1:{port}/metrics"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"metrics at http://127.0.0.1:{port}/metrics" in err
    assert list(list_tiers(str(tier_dirs[0]))) == [], "zkv up's clean stop removes the CPU tier files it made"


def corrupt(path: Path, offset: int, n: int = 64) -> None:
    """Bytes changed behind zkv's back (the rank holds the file open)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in f.read(n)))
        f.flush()


def test_up_gives_every_rank_its_tiers_and_status_and_metrics_show_each_tier(bus, tier_dirs):
    """Rows 40-43 filled and spilled, two loaded back, then one CPU row and one
    disk block corrupted on each rank: the scrape and ``zkv status`` show each
    tier's blocks, bytes, mode and digest failures, and the spill and load times."""
    frontend, url = bus
    cpu_dir, disk_dir = tier_dirs
    files = {t.rank: t for t in list_tiers(str(cpu_dir))}
    assert sorted(files) == [0, 1] and all(t.owned for t in files.values()), "a held tier file per rank"
    assert sorted(p.name for p in disk_dir.iterdir()) == ["zkv-rank0.disk", "zkv-rank1.disk"]
    before = scrape(url)
    with Client(frontend) as client:
        assert client.run("fill", None, [40, 41, 42, 43], tier="cpu", seed=4, timeout=30).ok
        assert client.run("spill", [40, 41, 42, 43], [10, 11, 12, 13], timeout=30).ok
        assert client.run("load", [10, 11], [50, 51], timeout=30).ok
        direct = client.status().ranks[0].stats["disk"]["direct"]
        slot = disk_io.align_up(BLOCK_BYTES) if direct else BLOCK_BYTES
        for rank, tier in files.items():
            corrupt(tier.path, HEADER_BYTES + 43 * tier.row_bytes)
            corrupt(disk_dir / f"zkv-rank{rank}.disk", disk_io.ALIGN + disk_io.align_up(DISK_BLOCKS * 32) + 13 * slot)
        lost = client.run("swap_in", [43], [5], timeout=30)
        assert lost.outcome == "failed" and "lost_block" in lost.reason, lost.reason
        torn = client.run("load", [13], [52], timeout=30)
        assert torn.outcome == "failed" and "disk_lost" in torn.reason, torn.reason
        client.pause()  # the acks carry the ranks' fresh stats
        mid = scrape(url)
        text = zkv("status", "--broker", frontend).stdout
        client.resume()

    def delta(name: str, **labels: str) -> float:
        return value(mid, name, **labels) - before.get((name, tuple(sorted(labels.items()))), 0)

    for rank in ("0", "1"):
        cpu, disk = {"rank": rank, "tier": "cpu"}, {"rank": rank, "tier": "disk"}
        assert value(mid, "zkv_tier_blocks", **cpu) == 64 and value(mid, "zkv_tier_blocks", **disk) == DISK_BLOCKS
        assert delta("zkv_tier_blocks_used", **cpu) == 5, "4 filled, 2 loaded, 1 lost"
        assert delta("zkv_tier_blocks_used", **disk) == 4
        assert value(mid, "zkv_tier_digest_failures_total", **cpu) == 1
        assert value(mid, "zkv_tier_digest_failures_total", **disk) == 1
        assert value(mid, "zkv_tier_kept", **cpu) == 0 and value(mid, "zkv_tier_kept", **disk) == 0
        assert value(mid, "zkv_cache_bytes", **cpu) == 64 * BLOCK_BYTES
        assert value(mid, "zkv_cache_bytes", **disk) >= DISK_BLOCKS * BLOCK_BYTES
        assert value(mid, "zkv_disk_direct", rank=rank) == (1 if direct else 0)
        assert value(mid, "zkv_disk_io_errors_total", rank=rank, io="read") == 0
        assert delta("zkv_copy_seconds_count", rank=rank, op="spill") == 1
        assert delta("zkv_copy_seconds_count", rank=rank, op="load") == 1, "the failed load is not timed"
        assert value(mid, "zkv_copy_seconds_sum", rank=rank, op="load") > 0
        line = next(x for x in text.splitlines() if x.startswith(f"rank {rank} cpu: "))
        assert "fresh" in line and f"file {files[int(rank)].path}, digests" in line and "1 digest failures" in line
        line = next(x for x in text.splitlines() if x.startswith(f"rank {rank} disk: "))
        assert f"/{DISK_BLOCKS} blocks" in line and ("O_DIRECT" if direct else "buffered") in line
        assert "1 digest failures" in line


def test_metrics_endpoint_counts_known_work(bus):
    frontend, url = bus
    before = scrape(url)
    assert value(before, "zkv_ranks_alive") == 2 and value(before, "zkv_bus_state", state="running") == 1
    with Client(frontend) as client:
        for i in range(10):
            assert client.run("swap_out", [i, i + 10], [i, i + 20], timeout=30).ok
        client.pause()  # the acks carry the ranks' fresh stats
        mid = scrape(url)
        client.resume()
    ok = {"op": "swap_out", "outcome": "ok"}
    assert value(mid, "zkv_tasks_total", **ok) - before.get(("zkv_tasks_total", tuple(sorted(ok.items()))), 0) == 10
    assert value(mid, "zkv_task_round_trip_seconds_count", **ok) >= 10
    assert value(mid, "zkv_bus_state", state="paused") == 1
    assert value(mid, "zkv_control_ops_total", op="pause", result="ok") >= 1
    for rank in ("0", "1"):
        assert value(mid, "zkv_bytes_moved_total", op="swap_out", rank=rank) >= 10 * 2 * BLOCK_BYTES
        assert value(mid, "zkv_copy_seconds_count", rank=rank, op="swap_out") >= 10
        assert value(mid, "zkv_cache_bytes", rank=rank, tier="gpu") == 32 * BLOCK_BYTES
        assert value(mid, "zkv_rank_copies_after_ack_total", rank=rank) == 0


def test_status_prints_a_table(bus):
    frontend, _ = bus
    res = zkv("status", "--broker", frontend)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("bus RUNNING") and "world 2" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    assert lines[header].split()[:3] == ["rank", "alive", "last"]
    rows = [line.split() for line in lines[header + 2 : header + 4]]
    assert [r[:2] for r in rows] == [["0", "yes"], ["1", "yes"]]


def test_status_watch_redraws_until_interrupted(bus):
    frontend, _ = bus
    proc = subprocess.Popen(
        [sys.executable, "-m", "zkv", "status", "--broker", frontend, "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    redraws, deadline = 0, time.monotonic() + 60
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while redraws < 3 and time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                line = proc.stdout.readline()
                assert line, f"the watch ended early: {proc.stderr.read()}"
                redraws += line.startswith("zkv status at ")
    assert redraws == 3
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_metrics_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ep = Endpoints.in_dir(tmp_path)
        res = zkv(
            "broker",
            "--frontend",
            ep.frontend,
            "--backend",
            ep.backend,
            "--control",
            ep.control,
            "--metrics-port",
            str(port),
            timeout=60,
        )
    assert res.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in res.stderr and "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.glob("*.sock")) == []  # refused before anything was bound


def test_every_metric_the_operations_doc_names_is_in_a_scrape(bus):
    """A panel or alert of docs/operations.md that names a series the broker
    does not export shows nothing, silently: every name in a query must be a
    sample name of a real scrape (a histogram's are _bucket, _sum, _count),
    and every name in the tables a sample or a histogram family."""
    frontend, url = bus
    with Client(frontend) as client:  # one of each, so that every histogram has its series
        assert client.run("swap_out", [1], [1], timeout=30).ok
        client.pause()
        client.resume()
    samples = {name for name, _ in scrape(url)}
    histograms = {n[: -len("_count")] for n in samples if n.endswith("_count")}
    doc = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    metric = re.compile(r"\bzkv_[a-z_]*[a-z]\b")
    prose = re.sub(r"```.*?```", "", doc, flags=re.S)  # inline spans pair up only outside the fenced blocks
    panels = re.search(r"Useful panels:(.*?)\n\n", prose, flags=re.S)
    assert panels is not None
    queries = re.findall(r"expr: (.*)", doc) + re.findall(r"`([^`]+)`", panels.group(1))
    queries += [q for q in re.findall(r"`([^`]+)`", prose) if "(" in q]
    in_queries = {name for q in queries for name in metric.findall(q)}
    assert "zkv_control_duration_seconds_bucket" in in_queries  # the control-op panel
    assert sorted(in_queries - samples) == []
    # a vLLM engine's embedded broker also exports its groups' counts (tests/test_vllm_groups.py scrapes them)
    engine_only = {"zkv_vllm_group_blocks_total"}
    assert sorted(set(metric.findall(doc)) - samples - histograms - engine_only) == []


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@long_e2e("a replay on an embedded cluster, then a plot, 15-30 s", "test_plots.py and test_bench_plot_draws_the_report")
def test_trace_plot_draws_a_recording(tmp_path):
    pytest.importorskip("matplotlib")
    trace, rec, png = tmp_path / "t.jsonl", tmp_path / "rec.jsonl", tmp_path / "rec.png"
    res = zkv("trace", "gen", "rl-cycle", "--tasks", "40", "--every", "10", *LAYOUT_ARGS, "-o", str(trace))
    assert res.returncode == 0, res.stderr
    refused = zkv("trace", "plot", str(trace), "-o", str(png))  # a hand-made trace has no outcomes to plot
    assert refused.returncode == 2 and "no outcome records" in refused.stderr and not png.exists()
    res = zkv("replay", str(trace), "--speed", "max", "--record", str(rec))
    assert res.returncode == 0, res.stdout + res.stderr
    res = zkv("trace", "plot", str(rec), "-o", str(png))
    assert res.returncode == 0, res.stderr
    width, height = png_size(png)
    assert width >= 800 and height >= 300 and png.stat().st_size > 20_000


def test_bench_plot_draws_the_report(tmp_path):
    """In this process (click's runner): the benchmark's ranks fork from the test run's zygote instead of
    each importing torch."""
    from test_operator_paths import cli

    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    res = cli("bench", "pause", "--quick", "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert "pause idle p50" in res.stdout and f"wrote {png}" in res.stderr
    width, height = png_size(png)
    assert width >= 400 and height >= 300 and png.stat().st_size > 10_000
