"""What recording metrics costs, beside the same run's baseline without it
(``python -m zkv.harness.bus.metrics_bench [--bus]``, or ``zkv bench bus --metrics-cost``).

The hooks sit inside ``BrokerCore`` and the rank executor, so "without
metrics" is the same code with a no-op book (:class:`NullBusBook`): what
remains of the hook then is one method call and its arguments (``task_op``
of the body), which :func:`bench_metrics_overhead` times separately as
``hook_calls_alone``, so neither figure hides it.

The broker core is driven with no sockets: per task one submit and one
``done`` per rank, frames encoded beforehand, so the figure is the core's
per-task work (decode, fold, dispatch, books).  CPU time of this thread
(``thread_time``: a loaded machine's descheduling does not count), short
rounds alternated, reported as the median over rounds of booked / no-op.
One scrape's ``collect()`` is timed too.  End to end
(:func:`bench_bus_with_metrics`): a local cluster with ``zkv broker
--metrics-port`` scraped every second, beside one whose broker and ranks
book into no-op books and export nothing.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from ...broker.core import BrokerConfig, BrokerCore
from ...obs.book import BusBook, task_op
from ...obs.stats import cpu_seconds
from ...wire import protocol as P
from ...wire.layout import CacheLayout
from ...wire.messages import Done, Ready, Submit
from ...wire.vocab import RankOutcome

if TYPE_CHECKING:  # imported lazily at run time: the core benchmark needs neither sockets nor torch
    from ...broker import Broker
    from ...rank.worker import RankWorker
    from .cluster import LocalCluster

CLIENT = b"client-1"
LAYOUT = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=128, block_size=16, kv_heads=2, head_dim=64)


class NullBusBook(BusBook):
    """A book that books nothing: the baseline "without metrics"."""

    def task_finished(self, *args: Any, **kwargs: Any) -> None:
        pass

    def control_finished(self, *args: Any, **kwargs: Any) -> None:
        pass

    def bad_request(self, *args: Any, **kwargs: Any) -> None:
        pass


class NullRankBook:
    """A rank book that books and reports nothing."""

    def task_done(self, op: str, seconds: float, nbytes: int) -> None:
        pass

    def to_stats(self) -> dict[str, Any]:
        return {}


def _frames(tasks: int, world: int, ids: int) -> tuple[list, list]:
    body = P.encode_body("swap_out", list(range(ids)), list(range(ids)))
    submits = [[Submit(task=i + 1, reply_to="ipc:///tmp/zkv-bench-client").to_wire(), body] for i in range(tasks)]
    dones = [
        [
            (
                f"rank-{r}".encode(),
                [Done(seq=i + 1, n=i + 1, outcome=RankOutcome.OK, gen=0, bytes=ids * LAYOUT.block_bytes).to_wire()],
            )
            for r in range(world)
        ]
        for i in range(tasks)
    ]
    return submits, dones


def _core(null_book: bool, world: int) -> Any:
    core = BrokerCore(BrokerConfig(world=world), book=NullBusBook() if null_book else None)
    for r in range(world):
        core.on_rank(
            f"rank-{r}".encode(),
            [Ready(rank=r, world=world, session=1, layout=LAYOUT, gen=0).to_wire()],
            0.0,
        )
    return core


def _run_core(null_book: bool, submits: list, dones: list, world: int) -> float:
    core = _core(null_book, world)
    now = 1.0
    t0 = time.thread_time()
    for sub, done in zip(submits, dones):
        core.on_client(CLIENT, sub, now)
        for identity, frames in done:
            core.on_rank(identity, frames, now)
    elapsed = time.thread_time() - t0
    assert core.counters["ok"] == len(submits), core.counters
    return elapsed / len(submits)


def _run_hooks(tasks: int, world: int, body: bytes) -> float:
    book = BusBook()
    t0 = time.thread_time()
    for _ in range(tasks):
        book.task_finished(task_op(body), "ok", 0.0004, 8192)
    return (time.thread_time() - t0) / tasks


def bench_metrics_overhead(tasks: int = 2_000, rounds: int = 30, world: int = 2, ids: int = 1) -> dict[str, Any]:
    from ...obs.prometheus import make_registry

    submits, dones = _frames(tasks, world, ids)
    runs: dict[bool, list[float]] = {True: [], False: []}  # null book?
    for i in range(rounds):  # alternate the order, so drift hits both
        for null_book in (True, False) if i % 2 == 0 else (False, True):
            runs[null_book].append(_run_core(null_book, submits, dones, world))
    plain, booked = runs[True], runs[False]
    hooks = min(_run_hooks(tasks, world, submits[0][1]) for _ in range(rounds))
    core = _core(False, world)
    for sub, done in zip(submits[:2000], dones[:2000]):
        core.on_client(CLIENT, sub, 1.0)
        for identity, frames in done:
            core.on_rank(identity, frames, 1.0)
    registry = make_registry(core)
    from prometheus_client import generate_latest

    t0 = time.thread_time()
    for _ in range(20):
        text = generate_latest(registry)
    scrape = (time.thread_time() - t0) / 20
    med = statistics.median
    ratio = med(m / p for p, m in zip(plain, booked))
    return {
        "tasks_per_round": tasks,
        "rounds": rounds,
        "world": world,
        "ids_per_task": ids,
        "null_book_core_us_per_task": {"median": med(plain) * 1e6, "min": min(plain) * 1e6},
        "core_us_per_task": {"median": med(booked) * 1e6, "min": min(booked) * 1e6},
        "overhead_of_core_pct_median_of_rounds": (ratio - 1) * 100,
        "overhead_us_per_task": (med(booked) - med(plain)) * 1e6,
        "hook_calls_alone_us_per_task": hooks * 1e6,
        "scrape_ms": scrape * 1e3,
        "scrape_bytes": len(text),
    }


# --- end to end: the bus with and without metrics, same run ----------------------------


def _serve_unmetered(argv: list[str]) -> None:
    """``broker FRONT BACK CONTROL WORLD`` or ``worker RANK WORLD BACK CONTROL LAYOUT_JSON``:
    ``zkv broker`` / ``zkv worker`` with no-op books and no exporter (the baseline)."""
    import signal

    from ...net.endpoints import Endpoints

    role, args = argv[0], argv[1:]
    server: Broker | RankWorker
    if role == "broker":
        from ...broker import Broker

        front, back, control, world = args
        server = Broker(Endpoints(front, back, control), BrokerConfig(world=int(world)), book=NullBusBook())
    else:
        from ...rank.worker import RankWorker, set_torch_threads

        set_torch_threads(1)  # this is the rank process's entry point
        rank, world, back, control, layout = args
        server = RankWorker(
            int(rank), int(world), back, control, CacheLayout.from_wire(json.loads(layout)), device="cpu"
        )
        server.executor.book = NullRankBook()  # type: ignore[assignment]
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    server.serve()


def _unmetered_cluster(ranks: int, layout: CacheLayout) -> LocalCluster:
    import subprocess

    from .cluster import LocalCluster

    class UnmeteredCluster(LocalCluster):
        def _run(self, args: list[str]) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-m", "zkv.harness.bus.metrics_bench", *args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        def start_broker(self) -> None:
            ep = self.endpoints
            self.broker = self._run(["broker", ep.frontend, ep.backend, ep.control, str(self.ranks)])

        def start_worker(self, rank: int, extra: Any = (), layout: CacheLayout | None = None) -> subprocess.Popen:
            proc = self.workers[rank] = self._run(
                [
                    "worker",
                    str(rank),
                    str(self.ranks),
                    self.endpoints.backend,
                    self.endpoints.control,
                    json.dumps((layout or self.layout).to_wire()),
                ]
            )
            return proc

    return UnmeteredCluster(ranks, layout, quiet=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_bus_with_metrics(
    rounds: int = 3, n_tput: int = 5000, window: int = 64, scrape_every_s: float = 1.0
) -> dict[str, Any]:
    """Pipelined 1-block swap_out throughput of a local cluster with metrics
    (``zkv broker --metrics-port``, ``/metrics`` scraped every ``scrape_every_s``
    during the run) and without (no-op books, no exporter), alternated ``rounds`` times."""
    import threading
    import urllib.request

    from .bench import _measure
    from .cluster import LocalCluster

    layout = CacheLayout()
    body = P.encode_body("swap_out", [1], [2])
    plain: list[float] = []
    metered: list[float] = []
    scrapes = [0]
    cpu: dict[bool, list[float]] = {False: [], True: []}

    def scrape(stop: threading.Event, url: str) -> None:
        while not stop.wait(scrape_every_s):
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            scrapes[0] += 1

    for i in range(rounds):
        for with_metrics in (False, True) if i % 2 == 0 else (True, False):
            port = _free_port()
            cluster = (
                LocalCluster(2, layout, quiet=True, broker_args=["--metrics-port", str(port)])
                if with_metrics
                else _unmetered_cluster(2, layout)
            )
            stop = threading.Event()
            with cluster, cluster.client() as client:
                scraper = threading.Thread(target=scrape, args=(stop, f"http://127.0.0.1:{port}/metrics"), daemon=True)
                if with_metrics:
                    scraper.start()

                def collect(task: int) -> None:
                    if not client.wait(task, timeout=30).ok:
                        raise RuntimeError("benchmark task failed")

                broker = cluster.broker
                if broker is None:
                    raise RuntimeError("the cluster started no broker")
                cpu0 = cpu_seconds(broker.pid)
                res = _measure(lambda: client.submit_raw(body), collect, 20, n_tput, window)
                cpu[with_metrics].append((cpu_seconds(broker.pid) - cpu0) / (n_tput + 20 + 20) * 1e6)
                stop.set()
                if with_metrics:
                    scraper.join(timeout=10)
            (metered if with_metrics else plain).append(res["tasks_per_s"])
    med = statistics.median
    return {
        "rounds": rounds,
        "tasks_per_round": n_tput,
        "window": window,
        "plain_tasks_per_s": plain,
        "metered_tasks_per_s": metered,
        "scrapes": scrapes[0],
        "median_plain": med(plain),
        "median_metered": med(metered),
        "metered_vs_plain_pct": (med(metered) / med(plain) - 1) * 100,
        "broker_cpu_us_per_task": {"plain": cpu[False], "metered": cpu[True]},
        "broker_cpu_metered_vs_plain_pct": (med(cpu[True]) / med(cpu[False]) - 1) * 100,
    }


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:2] and sys.argv[1] in ("broker", "worker"):
        _serve_unmetered(sys.argv[1:])
        sys.exit(0)
    quick = "--quick" in sys.argv
    res = {"core": bench_metrics_overhead(rounds=6 if quick else 30)}
    if "--bus" in sys.argv:
        res["bus"] = bench_bus_with_metrics(rounds=1 if quick else 3, n_tput=1000 if quick else 5000)
    print(json.dumps(res, indent=1, default=lambda x: round(x, 3)))
