"""Prometheus metrics: a real broker and real ranks (threads, ipc:// sockets),
known work through a real client, then a real HTTP scrape parsed with
prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

import pytest
from inproc_bus import LAYOUT, InProcessBus
from prometheus_client.parser import text_string_to_metric_families

from zkv.broker.core import BrokerConfig, BrokerCore
from zkv.client.client import Client, ZkvError
from zkv.obs.book import COPY_BUCKETS_S, BusBook, Histogram, histogram_from_stats, task_op
from zkv.obs.prometheus import make_registry, metrics_port_from_env, start_metrics_server
from zkv.wire import protocol as P


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_scrape_after_known_work(tmp_path):
    with InProcessBus(tmp_path) as bus, Client(bus.endpoints.frontend) as client:
        server = start_metrics_server(0, make_registry(bus.broker.core))
        try:
            before = scrape(server.url)
            assert value(before, "zkv_ranks_alive") == 2
            assert value(before, "zkv_bus_state", state="running") == 1
            assert value(before, "zkv_tasks_total", op="swap_out", outcome="ok") == 0  # there from the start

            for i in range(10):
                assert client.run("swap_out", [i, i + 10], [i, i + 20], timeout=30).ok
            assert client.run("swap_in", [0], [40], timeout=30).outcome == "failed"  # gpu block 40 does not exist
            with pytest.raises(ZkvError):
                client.clear()  # not paused
            client.pause()  # acks carry fresh rank stats
            client.pause()  # noop
            client.submit_raw(b"\x81\xa1v\x01")  # queued while paused (the ranks fail it after the resume)
            client.ping()  # same connection: the broker has the submit when it answers
            mid = scrape(server.url)
            client.resume()
            client.dealer.send_multipart([b"not msgpack"])  # a bad request the broker answers with an error
            client.ping()
            after = scrape(server.url)
        finally:
            server.close()

    ok = {"op": "swap_out", "outcome": "ok"}
    assert value(after, "zkv_tasks_total", **ok) == 10
    assert value(after, "zkv_task_round_trip_seconds_count", **ok) == 10
    assert value(after, "zkv_task_round_trip_seconds_bucket", le="+Inf", **ok) == 10
    assert 0 < value(after, "zkv_task_round_trip_seconds_sum", **ok) < 30
    assert value(after, "zkv_tasks_total", op="swap_in", outcome="failed") == 1
    per_rank = 2 * LAYOUT.block_bytes  # two blocks per task, this rank's shard
    for rank in ("0", "1"):
        assert value(mid, "zkv_bytes_moved_total", op="swap_out", rank=rank) == 10 * per_rank
        assert value(mid, "zkv_rank_tasks_total", rank=rank, outcome="ok") == 10
        assert value(mid, "zkv_rank_tasks_total", rank=rank, outcome="failed") == 1
        assert value(mid, "zkv_copy_seconds_count", rank=rank, op="swap_out") == 10
        assert value(mid, "zkv_rank_copies_after_ack_total", rank=rank) == 0
        assert value(mid, "zkv_cache_bytes", rank=rank, tier="gpu") == LAYOUT.gpu_blocks * LAYOUT.block_bytes
        assert value(mid, "zkv_cache_bytes", rank=rank, tier="cpu") == LAYOUT.cpu_blocks * LAYOUT.block_bytes
        assert value(mid, "zkv_rank_alive", rank=rank) == 1
    assert value(after, "zkv_task_size_bytes_sum", op="swap_out") == 10 * 2 * per_rank
    assert value(after, "zkv_control_ops_total", op="pause", result="ok") == 1
    assert value(after, "zkv_control_ops_total", op="pause", result="noop") == 1
    assert value(after, "zkv_control_ops_total", op="clear", result="not_paused") == 1
    assert value(after, "zkv_control_ops_total", op="resume", result="ok") == 1
    assert value(after, "zkv_control_duration_seconds_count", op="pause") == 1
    assert value(mid, "zkv_bus_state", state="paused") == 1 and value(mid, "zkv_bus_state", state="running") == 0
    assert value(mid, "zkv_queue_depth") == 1  # the task submitted while paused
    assert value(after, "zkv_bus_state", state="running") == 1
    assert value(after, "zkv_epoch") == 2
    assert value(after, "zkv_bad_requests_total", code="malformed") == 1
    assert value(after, "zkv_undeliverable_total", source="broker", rank="") == 0
    assert value(after, "zkv_stale_messages_total", kind="ack", rank="") == 0


def test_registry_is_per_process_not_global(tmp_path):
    from prometheus_client import REGISTRY

    before = {m.name for m in REGISTRY.collect()}
    registry = make_registry(BrokerCore(BrokerConfig(world=1)))
    assert "zkv_bus_state" in {m.name for m in registry.collect()}
    assert {m.name for m in REGISTRY.collect()} == before


def test_port_from_environment(monkeypatch):
    monkeypatch.delenv("ZKV_METRICS_PORT", raising=False)
    assert metrics_port_from_env() is None
    assert start_metrics_server(None, make_registry(BrokerCore())) is None
    monkeypatch.setenv("ZKV_METRICS_PORT", "9464")
    assert metrics_port_from_env() == 9464
    assert metrics_port_from_env(0) == 0
    for bad in ("http", "70000", "-1"):
        monkeypatch.setenv("ZKV_METRICS_PORT", bad)
        with pytest.raises(ValueError, match="ZKV_METRICS_PORT"):
            metrics_port_from_env()


def test_task_op_peeks_the_op_and_bounds_the_label():
    for op in ("swap_out", "swap_in", "fill", "checksum"):
        assert task_op(P.encode_body(op, [1, 2], [3, 4])) == op
    assert task_op(b"") == "other"
    assert task_op(b"\x81\xa2op\xa9swap_side") == "other"
    assert task_op(b"\xa2op\xff") == "other"


def test_histogram_buckets_and_peer_stats_are_checked():
    h = Histogram((1.0, 2.0))
    for x in (0.5, 1.0, 1.5, 3.0):
        h.observe(x)
    assert h.counts == [2, 1, 1] and h.total == 6.0 and h.count == 4
    good = {"counts": [0] * (len(COPY_BUCKETS_S) + 1), "sum": 0.0}
    assert histogram_from_stats(good, COPY_BUCKETS_S) == (good["counts"], 0.0)
    for bad in (
        {"counts": [1], "sum": 0.0},
        {**good, "sum": float("nan")},
        {**good, "counts": [True] + good["counts"][1:]},
        {**good, "counts": [-1] + good["counts"][1:]},
        [1, 2],
        None,
    ):
        assert histogram_from_stats(bad, COPY_BUCKETS_S) is None


def test_label_sets_stay_bounded():
    book = BusBook()
    for i in range(1000):
        book.bad_request(f"code-{i}")
    assert len(book.bad_requests) <= 65
    assert sum(book.bad_requests.values()) == 1000


def test_overhead_bench_runs_every_variant_to_the_end():
    from zkv.harness.bus.metrics_bench import bench_metrics_overhead

    res = bench_metrics_overhead(tasks=200, rounds=3)  # each run asserts every task ended ok
    assert res["core_us_per_task"]["min"] > 0 and res["null_book_core_us_per_task"]["min"] > 0
    assert res["hook_calls_alone_us_per_task"] > 0 and res["scrape_bytes"] > 1000


def test_core_books_rank_death_and_a_failed_pause():
    """Sans-IO: a pause that fails because a rank died is booked as rank_dead, and
    the dead rank's task as failed; the scrape-time collector sees both."""
    from prometheus_client import generate_latest

    from zkv.wire.layout import CacheLayout

    core = BrokerCore(BrokerConfig(world=2, liveness_ms=1000))
    layout = CacheLayout().to_wire()
    for r in range(2):
        core.on_rank(f"rank-{r}".encode(), [P.encode("ready", rank=r, world=2, session=1, layout=layout, gen=0)], 0.0)
    core.on_client(b"c", [P.encode("submit", task=1, reply_to="ipc:///tmp/x"), P.encode_body("swap_in", [1], [2])], 0.1)
    core.on_rank(b"rank-0", [P.encode("done", seq=1, n=1, outcome="ok", gen=0, bytes=64)], 0.15)
    core.on_client(b"c", [P.encode("pause", req=1)], 0.2)
    core.on_rank(b"rank-0", [P.encode("hb")], 0.9)  # rank 0 answers, rank 1 stays silent
    core.on_tick(1.5)  # rank 1 is past its liveness window
    assert core.book.controls[("pause", "rank_dead")] == 1
    assert core.book.tasks[("swap_in", "failed")].rtt.count == 1  # rank 0 ok, rank 1 lost: failed, once
    text = generate_latest(make_registry(core)).decode()
    assert 'zkv_control_ops_total{op="pause",result="rank_dead"} 1.0' in text
    assert 'zkv_rank_alive{rank="1"} 0.0' in text and "zkv_ranks_alive 1.0" in text


def test_failure_series_exist_at_zero_before_the_first_failure():
    """The alerts of docs/operations.md take ``increase()`` of these series; one
    born at 1 with its first event would read 0 for that first failure."""
    from prometheus_client import generate_latest

    def samples(core: BrokerCore) -> dict:
        text = generate_latest(make_registry(core)).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    core = BrokerCore(BrokerConfig(world=2))
    start = samples(core)
    for op, result in (("pause", "rank_dead"), ("pause", "pause_timeout"), ("clear", "not_paused")):
        assert value(start, "zkv_control_ops_total", op=op, result=result) == 0
    assert value(start, "zkv_control_ops_total", op="resume", result="alloc_failed") == 0
    for op in ("swap_out", "swap_in", "fill", "checksum"):
        for outcome in ("ok", "failed", "cancelled", "rejected", "timeout"):
            assert value(start, "zkv_tasks_total", op=op, outcome=outcome) == 0
    for code in ("malformed", "bad_version", "unknown_kind", "bad_field", "too_large", "duplicate_task", "bad_submit"):
        assert value(start, "zkv_bad_requests_total", code=code) == 0
    assert value(start, "zkv_broker_events_total", event="rank_deaths") == 0

    core.book.control_finished("pause", "rank_dead", 0.1)
    core.book.bad_request("malformed")
    core.book.task_finished("swap_in", "failed", 0.01, 0)
    core.book.task_finished("swap_out", "timeout", 30.0, 0)
    core.book.events["rank_deaths"] += 1
    after = samples(core)  # the same series, now at 1: increase() sees the first one
    assert value(after, "zkv_control_ops_total", op="pause", result="rank_dead") == 1
    assert value(after, "zkv_bad_requests_total", code="malformed") == 1
    assert value(after, "zkv_tasks_total", op="swap_in", outcome="failed") == 1
    assert value(after, "zkv_tasks_total", op="swap_out", outcome="timeout") == 1
    assert value(after, "zkv_broker_events_total", event="rank_deaths") == 1
    assert value(after, "zkv_control_ops_total", op="pause", result="ok") == 0
