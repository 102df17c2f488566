"""Prometheus metrics for the bus, exported by the broker (one scrape target).

Why the broker exports everything, ranks included: a rank often lives inside
an engine's worker process (which may run its own ``/metrics`` already, and
has one per GPU: a port per rank means N ports per host to allocate and
scrape), while the broker already receives every rank's cumulative counters
in each heartbeat and ack.  So ranks open no port; their figures are at most
one heartbeat old, counters never lose an increment (they are cumulative),
and a dead rank's last figures stay visible next to ``zkv_rank_alive 0``.

Nothing here runs on the hot path: :class:`BusCollector` reads the broker
core's state and counters, its :class:`~zkv.obs.book.BusBook` and the
ranks' stats *at scrape time*, on the HTTP server's thread.  It only copies
(dict/list copies are atomic under the GIL) and never writes.  Every value
from a rank's stats is range-checked before it is exported.

Each exporter gets its own ``CollectorRegistry`` (:func:`make_registry`), so
an engine process that embeds a broker keeps its global registry clean.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from typing import Any, Iterator, overload

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..wire.vocab import CLIENT_OPS, RANK_OUTCOMES, BusState, ControlOp, Outcome, Tier
from .book import (
    BYTES_BUCKETS,
    CONTROL_BUCKETS_S,
    COPY_BUCKETS_S,
    COPY_OPS,
    OPS,
    RTT_BUCKETS_S,
    BusBook,
    histogram_from_stats,
)
from .tier_metrics import TierFamilies

PORT_ENV = "ZKV_METRICS_PORT"
ADDR_ENV = "ZKV_METRICS_ADDR"
STATES = tuple(s.value for s in BusState)  # every bus state, in the order of a control cycle

# rank stats key -> (stale message kind); broker counter key -> kind
_RANK_STALE = {
    "stale_controls": "control",
    "stale_welcomes": "welcome",
    "refused_stale_session": "task_session",
    "dropped_stale_session": "task_session",
}
_BROKER_STALE = {"stale_acks": "ack", "stray_done": "done"}

# Every label set an alert may watch exists from the first scrape, at 0: a
# series born at 1 makes ``increase()`` miss the first failure of its kind
# after a broker start (docs/operations.md, "What to alert on").
TASK_OUTCOMES = (Outcome.OK, Outcome.FAILED, Outcome.CANCELLED, Outcome.REJECTED, Outcome.TIMEOUT)
CONTROL_RESULTS = {
    ControlOp.PAUSE: (Outcome.OK, "noop", "busy", "rank_dead", "pause_timeout"),
    ControlOp.CLEAR: (Outcome.OK, "noop", "busy", "rank_dead", "clear_timeout", "not_paused"),
    ControlOp.RESUME: (
        Outcome.OK,
        "noop",
        "busy",
        "rank_dead",
        "resume_timeout",
        "not_cleared",
        "bad_field",
        "alloc_failed",
    ),
}
BAD_REQUEST_CODES = (
    "malformed",
    "bad_version",
    "unknown_kind",
    "bad_field",
    "too_large",
    "duplicate_task",
    "bad_submit",
)
BROKER_EVENTS = (
    "submitted",
    "dispatched",
    "rank_deaths",
    "registrations",
    "internal_errors",
    "publish_dropped",
    "state_save_failed",
    "alloc_failed",
    "gen_moves",
    "resume_rollbacks",
)


def _with_zeros(counts: dict[tuple, Any], known: Any) -> list[tuple[tuple, Any]]:
    """``counts`` plus every label set of ``known`` it lacks, at 0, in a stable order."""
    merged = dict.fromkeys(known, 0)
    merged.update(counts)
    return list(merged.items())


def _uint(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value < 2**53 else None


def _histogram(
    family: HistogramMetricFamily, labels: list[str], bounds: tuple[float, ...], counts: list[int], total: float
) -> None:
    cumulative, buckets = 0, []
    for bound, n in zip((*bounds, math.inf), counts):
        cumulative += n
        buckets.append((floatToGoString(bound), cumulative))
    family.add_metric(labels, buckets, total)


class BusCollector(Collector):
    """Reads a :class:`~zkv.broker.core.BrokerCore` (and its book) at scrape time."""

    def __init__(self, core: Any, book: BusBook | None = None):
        self.core = core
        self.book = book if book is not None else getattr(core, "book", None)

    def collect(self) -> Iterator[Any]:
        core = self.core
        ranks = list(core.ranks.values())
        counters = dict(core.counters)
        yield from self._bus_gauges(core, ranks)
        yield from self._rank_metrics(ranks)
        if self.book is not None:
            yield from self._book_metrics(self.book)
        und = CounterMetricFamily(
            "zkv_undeliverable",
            "Messages that could not be handed to their peer (gone or not reading): broker replies and rank results.",
            labels=["source", "rank"],
        )
        und.add_metric(["broker", ""], counters.get("undeliverable", 0))
        stale = CounterMetricFamily(
            "zkv_stale_messages",
            "Acks, results and controls from an earlier epoch, generation or session: counted and ignored.",
            labels=["kind", "rank"],
        )
        for key, kind in _BROKER_STALE.items():
            stale.add_metric([kind, ""], counters.get(key, 0))
        for rs in ranks:
            stats = rs.stats if isinstance(rs.stats, dict) else {}
            value = _uint(stats.get("undeliverable"))
            if value is not None:
                und.add_metric(["rank", str(rs.rank)], value)
            per_kind: dict[str, int] = {}
            for key, kind in _RANK_STALE.items():
                value = _uint(stats.get(key))
                if value is not None:
                    per_kind[kind] = per_kind.get(kind, 0) + value
            for kind, value in per_kind.items():
                stale.add_metric([kind, str(rs.rank)], value)
        yield und
        yield stale
        events = CounterMetricFamily(
            "zkv_broker_events", "Every event the broker core counts (its status counters), by name.", labels=["event"]
        )
        for (name,), value in sorted(
            _with_zeros({(k,): v for k, v in counters.items()}, ((e,) for e in BROKER_EVENTS))
        ):
            events.add_metric([name], value)
        yield events

    def _bus_gauges(self, core: Any, ranks: list) -> Iterator[Any]:
        state = GaugeMetricFamily("zkv_bus_state", "1 for the state the bus is in, 0 for the others.", labels=["state"])
        current = core.state
        for name in STATES:
            state.add_metric([name], 1.0 if name == current else 0.0)
        yield state
        yield GaugeMetricFamily("zkv_epoch", "Pause/clear/resume epoch (bumps on every control op).", value=core.epoch)
        yield GaugeMetricFamily("zkv_generation", "Cache generation (bumps on every clear).", value=core.gen)
        yield GaugeMetricFamily(
            "zkv_queue_depth", "Tasks queued at the broker, not yet dispatched.", value=len(core.queue)
        )
        yield GaugeMetricFamily(
            "zkv_tasks_inflight", "Tasks dispatched to the ranks and not yet ended.", value=len(core.inflight)
        )
        yield GaugeMetricFamily("zkv_world_size", "Ranks a task runs on.", value=core.cfg.world)
        yield GaugeMetricFamily(
            "zkv_ranks_alive", "Ranks registered and answering.", value=sum(1 for rs in ranks if rs.alive)
        )
        pending = core.pending
        op = GaugeMetricFamily(
            "zkv_control_pending", "1 while a pause/clear/resume is waiting for the ranks' acks.", labels=["op"]
        )
        for name in CLIENT_OPS:
            op.add_metric([name], 1.0 if pending is not None and pending.op == name else 0.0)
        yield op

    def _rank_metrics(self, ranks: list) -> Iterator[Any]:
        now = time.monotonic()
        alive = GaugeMetricFamily(
            "zkv_rank_alive", "1 while the rank answers heartbeats, 0 once declared dead.", labels=["rank"]
        )
        inflight = GaugeMetricFamily(
            "zkv_rank_inflight", "Tasks dispatched to the rank and not yet done (the broker's count).", labels=["rank"]
        )
        seen = GaugeMetricFamily(
            "zkv_rank_last_seen_seconds", "Seconds since the broker last heard from the rank.", labels=["rank"]
        )
        cache = GaugeMetricFamily(
            "zkv_cache_bytes",
            "Cache bytes allocated on the rank, per tier (as of its last heartbeat).",
            labels=["rank", "tier"],
        )
        tasks = CounterMetricFamily(
            "zkv_rank_tasks",
            "Tasks the rank executed, by its own result (as of its last heartbeat).",
            labels=["rank", "outcome"],
        )
        after_ack = CounterMetricFamily(
            "zkv_rank_copies_after_ack",
            "Copies a rank started after acking a pause. Must stay 0: anything else is a bug.",
            labels=["rank"],
        )
        moved = CounterMetricFamily(
            "zkv_bytes_moved", "Bytes a rank copied, by op (as of its last heartbeat).", labels=["op", "rank"]
        )
        copy = HistogramMetricFamily(
            "zkv_copy_seconds",
            "Time a rank spent on one successful copy task (validate, copy, hand off the result): swap_out and "
            "swap_in write and read its CPU tier, spill and load its disk tier.",
            labels=["rank", "op"],
        )
        tiers = TierFamilies()
        for rs in ranks:
            r = str(rs.rank)
            alive.add_metric([r], 1.0 if rs.alive else 0.0)
            inflight.add_metric([r], rs.inflight)
            seen.add_metric([r], max(0.0, now - rs.last_seen))
            stats = rs.stats if isinstance(rs.stats, dict) else {}
            gpu, cpu = _uint(stats.get("cache_bytes_gpu")), _uint(stats.get("cache_bytes_cpu"))
            if gpu is not None and cpu is not None:
                cache.add_metric([r, Tier.GPU], gpu)
                cache.add_metric([r, Tier.CPU], cpu)
                if (disk := _uint(stats.get("cache_bytes_disk"))) is not None:
                    cache.add_metric([r, Tier.DISK], disk)
                tiers.add(r, stats)
            elif (all_bytes := _uint(stats.get("cache_bytes"))) is not None:
                cache.add_metric([r, "all"], all_bytes)
            for outcome in RANK_OUTCOMES:
                v = _uint(stats.get(f"tasks_{outcome}"))
                if v is not None:
                    tasks.add_metric([r, outcome], v)
            v = _uint(stats.get("copies_after_ack"))
            if v is not None:
                after_ack.add_metric([r], v)
            by_op = stats.get("bytes_by_op")
            if isinstance(by_op, dict):
                for op in OPS:
                    v = _uint(by_op.get(op))
                    if v is not None:
                        moved.add_metric([op, r], v)
            copies = stats.get("copy_seconds")
            if isinstance(copies, dict):
                for op in COPY_OPS:
                    h = histogram_from_stats(copies.get(op), COPY_BUCKETS_S)
                    if h is not None:
                        _histogram(copy, [r, op], COPY_BUCKETS_S, *h)
        yield from (alive, inflight, seen, cache, tasks, moved, after_ack, copy, *tiers.families())

    def _book_metrics(self, book: BusBook) -> Iterator[Any]:
        rtt = HistogramMetricFamily(
            "zkv_task_round_trip_seconds", "Submit to final outcome of a task, at the broker.", labels=["op", "outcome"]
        )
        count = CounterMetricFamily(
            "zkv_tasks", "Tasks ended, by op and outcome (each task exactly once).", labels=["op", "outcome"]
        )
        size = HistogramMetricFamily(
            "zkv_task_size_bytes", "Bytes an ok task moved, summed over its ranks.", labels=["op"]
        )
        ended: dict[tuple, Any] = {}
        for (op, outcome), series in list(book.tasks.items()):
            counts, total = series.rtt.snapshot()
            _histogram(rtt, [op, outcome], RTT_BUCKETS_S, counts, total)
            ended[(op, outcome)] = sum(counts)
            if series.size is not None:
                _histogram(size, [op], BYTES_BUCKETS, *series.size.snapshot())
        for (op, outcome), n in _with_zeros(ended, ((op, o) for op in OPS for o in TASK_OUTCOMES)):
            count.add_metric([op, outcome], n)
        controls = CounterMetricFamily(
            "zkv_control_ops",
            "Pause/clear/resume requests by result: ok, noop, or the error code"
            " (rank_dead, pause_timeout, busy, not_paused, ...).",
            labels=["op", "result"],
        )
        known = ((op, result) for op, results in CONTROL_RESULTS.items() for result in results)
        for (op, result), v in _with_zeros(dict(book.controls), known):
            controls.add_metric([op, result], v)
        ctl = HistogramMetricFamily(
            "zkv_control_duration_seconds",
            "Completed pause (drain), clear and resume: request to the last rank's ack.",
            labels=["op"],
        )
        for (op,), h in list(book.control_seconds.items()):
            _histogram(ctl, [op], CONTROL_BUCKETS_S, *h.snapshot())
        bad = CounterMetricFamily(
            "zkv_bad_requests", "Frontend messages refused as bad input, by error code.", labels=["code"]
        )
        for (code,), v in _with_zeros(dict(book.bad_requests), ((c,) for c in BAD_REQUEST_CODES)):
            bad.add_metric([code], v)
        yield from (rtt, count, size, controls, ctl, bad)


def make_registry(core: Any, book: BusBook | None = None) -> CollectorRegistry:
    """A registry of its own (not the global one) exporting ``core``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BusCollector(core, book))
    return registry


class MetricsServer:
    """A running ``/metrics`` HTTP endpoint; ``close()`` stops it."""

    def __init__(self, httpd: Any, thread: threading.Thread):
        self.httpd = httpd
        self.thread = thread
        self.addr, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def metrics_port_from_env(port: int | None = None) -> int | None:
    """``port`` if given, else ``$ZKV_METRICS_PORT``, else None (no exporter)."""
    if port is not None:
        return port
    text = os.environ.get(PORT_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{PORT_ENV}={text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise ValueError(f"{PORT_ENV}={value} is not a port number (0-65535)")
    return value


def check_port_free(port: int, addr: str = "127.0.0.1") -> None:
    """Raise OSError when ``addr:port`` cannot be served now (taken, or not an
    address of this host), so that a command can refuse before it starts
    anything; port 0 always can."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
        probe.bind((addr, port))


@overload
def start_metrics_server(port: int, registry: CollectorRegistry, addr: str | None = None) -> MetricsServer: ...


@overload
def start_metrics_server(port: None, registry: CollectorRegistry, addr: str | None = None) -> MetricsServer | None: ...


def start_metrics_server(
    port: int | None, registry: CollectorRegistry, addr: str | None = None
) -> MetricsServer | None:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread.

    ``port`` None falls back to ``$ZKV_METRICS_PORT`` (no variable: returns
    None, nothing is served); 0 picks a free port (see ``.port``).  ``addr``
    defaults to ``$ZKV_METRICS_ADDR`` or loopback: like every zkv socket, it is
    reachable from other hosts only when asked for.
    """
    port = metrics_port_from_env(port)
    if port is None:
        return None
    addr = addr or os.environ.get(ADDR_ENV) or "127.0.0.1"
    httpd, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(httpd, thread)
