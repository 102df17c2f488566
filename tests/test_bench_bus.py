"""``zkv bench bus`` runs zkv and the raw relay in alternating rounds and
reports the bus beside the relay; a small run checks every figure is there and
sane (speed itself is the benchmark's business, never a test's)."""

from zkv.cli.bench import _summary
from zkv.harness.bus.bench import BUS_TARGETS, bench_bus
from zkv.wire.layout import CacheLayout


def test_the_bus_benchmark_reports_both_systems_and_the_targets():
    report = bench_bus(1, CacheLayout(), n_latency=30, n_tput=300, window=16, rounds=2)
    for name in ("zkv", "raw_pyzmq_relay"):
        r = report[name]
        assert r["tasks_per_s"] > 0 and len(r["tasks_per_s_rounds"]) == 2
        assert r["rtt_us"]["n"] == 60 and 0 < r["rtt_us"]["p50"] <= r["rtt_us"]["p99"]
        assert set(r["cpu_us_per_task"]) == {"client", "broker", "rank0", "rank1"}
    vs = report["vs_relay"]
    assert vs["throughput"] == report["zkv"]["tasks_per_s"] / report["raw_pyzmq_relay"]["tasks_per_s"]
    cpu = [sum(report[name]["cpu_us_per_task"].values()) for name in ("zkv", "raw_pyzmq_relay")]
    assert vs["cpu_per_task"] == cpu[0] / cpu[1] and vs["cpu_per_task"] > 0
    assert vs["window"] == 16 and vs["rounds"] == 2
    text = _summary({"bus_1_blocks": report})
    assert "vs relay: throughput" in text and f"target >= {BUS_TARGETS['throughput']}x" in text
    assert f"CPU per task (all processes) {vs['cpu_per_task']:.2f}x" in text
