"""Replay against real local clusters: the traces under tests/traces, the
``zkv replay`` / ``zkv trace`` commands, and record -> replay -> record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from profiles import long_e2e

from zkv.cli.commands import main
from zkv.harness.bus.cluster import LocalCluster
from zkv.replay import format_report, replay
from zkv.trace import check_recording, compare_outcomes, load_trace
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=128, block_size=16, kv_heads=2, head_dim=64)
TRACES = sorted((Path(__file__).parent / "traces").glob("*.jsonl"))


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()  # click >= 8.2 keeps stderr apart by itself


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=["--heartbeat-ms", "100"]).start(timeout=60)
    yield c
    assert c.stop().codes == {"rank0": 0, "rank1": 0, "broker": 0}


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_trace_replays_as_expected(cluster, path):
    trace = load_trace(str(path))
    assert trace.layout == LAYOUT
    report = replay(trace, cluster.endpoints.frontend, task_timeout=10, op_timeout=10)
    text = format_report(report)
    assert report.tasks == len(trace.tasks) and sum(report.outcomes.values()) == report.tasks, text
    assert all(r["copies_after_ack"] == 0 for r in report.ranks), text
    want = trace.header.extra.get("test_violations")
    if want is None:
        assert report.ok, text
    else:  # a trace that must fail: exactly the violations it names, by line
        assert not report.ok and [v["lines"] for v in report.violations] == want, text


def test_cli_replays_stdin_against_a_broker_as_json(cluster):
    runner = _runner()
    gen = runner.invoke(
        main,
        [
            "trace",
            "gen",
            "steady",
            "--tasks",
            "40",
            "--seed",
            "2",
            "--rate",
            "2000",
            "--layers",
            "2",
            "--gpu-blocks",
            "64",
            "--cpu-blocks",
            "128",
            "--kv-heads",
            "2",
        ],
    )
    assert gen.exit_code == 0, gen.stderr
    res = runner.invoke(
        main,
        ["replay", "-", "--broker", cluster.endpoints.frontend, "--speed", "max", "--json", "--task-timeout", "10"],
        input=gen.stdout,
    )
    assert res.exit_code == 0, res.stdout + res.stderr
    rep = json.loads(res.stdout)
    assert rep["ok"] and rep["outcomes"] == {"ok": 40} and rep["source"] == "<stdin>"
    assert rep["latency_ms"]["n"] == 40 and rep["latency_ms"]["p50"] <= rep["latency_ms"]["p99"]
    assert rep["throughput_tasks_per_s"] > 0 and rep["target"] == cluster.endpoints.frontend


def test_cli_bad_trace_exits_2_naming_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"zkv_trace": 1, "world": 2}\n{"ev": "pause"}\n{"ev": "submit", "op": "swap", "src": [1], "dst": [1]}\n'
    )
    runner = _runner()
    for args in (["replay", str(bad)], ["trace", "check", str(bad)]):
        res = runner.invoke(main, args)
        assert res.exit_code == 2
        assert (
            res.stderr.strip() == f"zkv: error: bad trace: {bad}, line 3: unknown op 'swap'; "
            "expected one of swap_out, swap_in, fill, checksum, spill, load, put, get"
        )
    res = runner.invoke(main, ["replay", "-"], input='{"zkv_trace": 7, "world": 2}\n')
    assert res.exit_code == 2 and "<stdin>, line 1: unsupported trace format version 7" in res.stderr


@long_e2e("two replays on embedded clusters, 20-35 s", "test_trace_replays_as_expected")
def test_record_replay_record_gives_the_same_outcomes(tmp_path):
    """gen -> replay with --record (rec1) -> replay rec1 with --record (rec2): same outcomes per task."""
    runner = _runner()
    gen, rec1, rec2 = tmp_path / "gen.jsonl", tmp_path / "rec1.jsonl", tmp_path / "rec2.jsonl"
    res = runner.invoke(
        main,
        [
            "trace",
            "gen",
            "rl-cycle",
            "--tasks",
            "24",
            "--every",
            "6",
            "--seed",
            "9",
            "-o",
            str(gen),
            "--layers",
            "2",
            "--gpu-blocks",
            "64",
            "--cpu-blocks",
            "128",
            "--kv-heads",
            "2",
        ],
    )
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(main, ["replay", str(gen), "--record", str(rec1), "--speed", "max", "--task-timeout", "10"])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "OK:" in res.stdout and "cancelled 4, ok 16, rejected 4" in res.stdout
    first = load_trace(str(rec1))
    assert first.layout == LAYOUT and first.world == 2  # the embedded cluster's layout reached the header
    assert check_recording(first) == []
    res = runner.invoke(main, ["replay", str(rec1), "--record", str(rec2), "--json", "--task-timeout", "10"])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["outcomes"] == {
        "cancelled": 4,
        "ok": 16,
        "rejected": 4,
    }  # rejected submits are recorded too
    second = load_trace(str(rec2))
    assert compare_outcomes(first, second) == []
    wanted = [s.expects[0][1][0] for s in _in_order(load_trace(str(gen)))]
    assert [s.recorded[0][1] for s in _in_order(first)] == wanted
    res = runner.invoke(main, ["trace", "diff", str(rec1), str(rec2)])
    assert res.exit_code == 0 and "same outcomes for all 24 tasks" in res.stdout


def _in_order(trace):
    return sorted(trace.tasks.values(), key=lambda s: s.index)


def test_a_stop_whose_ranks_neither_stop_nor_are_seen_to_die_is_bounded_and_removes_what_the_cluster_made(tmp_path):
    """A loaded machine, made certain: rank 0 is frozen (SIGTERM waits), and the zygote that reports the workers'
    exits is frozen too, so no exit is seen in time. stop() names what it killed, never raises, and removes the
    cluster's directory and the tier files and locks of its bus."""
    import os
    import signal
    import time

    from zkv.rank.tiers.tier_file import bus_name, list_tiers
    from zkv.testing.runner import zygote

    tiers = tmp_path / "tiers"
    c = LocalCluster(2, LAYOUT, quiet=True, worker_args=["--tier-dir", str(tiers)], tier_dir=str(tiers))
    c.start(timeout=60)
    bus = bus_name(c.endpoints.backend)
    assert {t.rank for t in list_tiers(str(tiers)) if t.bus == bus} == {0, 1}
    spawner = zygote.current()
    assert spawner is not None, "the test process forks its workers from a zygote (tests/conftest.py)"
    os.kill(c.workers[0].pid, signal.SIGSTOP)
    os.kill(spawner.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        end = c.stop(timeout=1.0)
        took = time.monotonic() - started
    finally:
        os.kill(spawner.pid, signal.SIGCONT)
    assert took < 1.0 + 5.0 + 5.0, f"the stop took {took:.1f} s"
    assert "rank0" in end.killed and end.codes["rank0"] is None, end
    said = end.said(1.0)
    assert "rank0" in said and "did not stop within 1 s of SIGTERM and were killed" in said, said
    assert not c.directory.exists(), "the cluster's own directory is removed"
    assert [t for t in list_tiers(str(tiers)) if t.bus == bus] == [], "its tier files are removed"
    assert [p for p in tiers.iterdir() if p.name.endswith(".lock")] == [], "and its rank locks"


def test_an_embedded_replay_that_stops_cleanly_says_nothing_of_its_teardown(tmp_path):
    from zkv.harness.bus.local_replay import replay_embedded
    from zkv.trace import generate, parse_trace

    trace = parse_trace([json.dumps(r) for r in generate("rl-cycle", 20, seed=1, layout=LAYOUT, every=10)])
    report = replay_embedded(trace, speed=None, task_timeout=10, op_timeout=10)
    assert report.ok, format_report(report)
    assert report.teardown == "" and not any("exited" in note for note in report.notes), report.notes
