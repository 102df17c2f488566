"""``zkv bench``: measured speed, each figure next to a baseline from the same run.

- ``bus``: task round trip (p50/p99, one in flight) and pipelined throughput with
  2 ranks, 1-block and 256-scattered-block tasks, beside a raw pyzmq relay of
  the same hops and message sizes (client DEALER -> ROUTER/ROUTER -> rank
  DEALERs -> PUSH to the client's PULL) that does no work.
- ``copy``: the rank's coalescing copy engine beside a plain contiguous
  ``copy_`` of the same bytes and an ``index_select``/``index_copy_`` gather;
  and the engine-attached copy engine on a per-layer and a block-major
  layout beside a plain ``copy_`` of the same bytes.
- ``pause``: pause and resume latency with idle ranks and with tasks in
  flight, split into drain time and the overhead beyond it.
These machines are noisy: compare figures within one run only.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from typing import Any, Callable

import zmq

from ...obs.stats import cpu_seconds, percentiles
from ...wire import protocol as P
from ...wire.layout import CacheLayout

# The targets for 1-block tasks beside the relay, and for a pause's cost beyond its drain.
BUS_TARGETS = {"throughput": 0.5, "rtt_p50": 2.0, "rtt_p99": 3.0, "cpu_per_task": 1.5, "pause_overhead_p99_ms": 2.0}


# --- the raw relay baseline -----------------------------------------------------------


def _relay_broker(front: str, back: str, ranks: int, ready: Any) -> None:
    ctx = zmq.Context()
    fe, be = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for s in (fe, be):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
    fe.bind(front)
    be.bind(back)
    ids: list[bytes] = []
    while len(ids) < ranks:  # the ranks say hello first
        if be.poll(10_000):
            ids.append(be.recv_multipart(zmq.NOBLOCK)[0])
        else:
            return
    ready.set()
    poller = zmq.Poller()
    poller.register(fe, zmq.POLLIN)
    poller.register(be, zmq.POLLIN)
    while True:
        ev = dict(poller.poll(120_000))  # idle while zkv is measured between rounds
        if not ev:
            return
        if fe in ev:
            while True:
                try:
                    frames = fe.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frames[-1] == b"stop":
                    for rid in ids:
                        be.send_multipart([rid, b"stop"])
                    return
                for rid in ids:
                    be.send_multipart([rid, *frames[1:]])
        if be in ev:
            while True:
                try:
                    be.recv_multipart(zmq.NOBLOCK)  # "done" credits, as zkv ranks send
                except zmq.Again:
                    break


def _relay_rank(back: str) -> None:
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(back)
    d.send(b"hello")
    pushes: dict[bytes, zmq.Socket] = {}
    while d.poll(120_000):
        frames = d.recv_multipart(zmq.NOBLOCK)
        if frames[0] == b"stop":
            return
        header, body = frames
        reply_to = header  # the relay's header is just the reply address
        sock = pushes.get(reply_to)
        if sock is None:
            sock = pushes[reply_to] = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(reply_to.decode())
        sock.send(body[:32])
        d.send(b"done")


def _measure(
    submit: Callable[[], Any],
    collect: Callable[[Any], None],
    n_latency: int,
    n_tput: int,
    window: int,
    pids: dict[str, int] | None = None,
) -> dict:
    """Round trips with one task in flight, then pipelined throughput with
    ``window`` in flight (the oldest collected first, as an engine would);
    with ``pids``, the CPU each of those processes spent per pipelined task."""
    for _ in range(20):  # warm up connections and caches
        collect(submit())
    rtts = []
    for _ in range(n_latency):
        t0 = time.perf_counter()
        collect(submit())
        rtts.append((time.perf_counter() - t0) * 1e6)
    cpu0 = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
    t0 = time.perf_counter()
    pending: collections.deque = collections.deque()
    for _ in range(n_tput):
        pending.append(submit())
        if len(pending) >= window:
            collect(pending.popleft())
    for h in pending:
        collect(h)
    elapsed = time.perf_counter() - t0
    cpu = {name: (cpu_seconds(pid) - cpu0[name]) / n_tput * 1e6 for name, pid in (pids or {}).items()}
    return {"rtt_samples_us": rtts, "tasks_per_s": n_tput / elapsed, "cpu_us_per_task": cpu}


class RawRelay:
    """The baseline: the same hops and message sizes as zkv with no work, no
    validation and no bookkeeping (processes started once, measured between
    zkv's rounds)."""

    def __init__(self, ids: int, ranks: int = 2):
        self.ids, self.ranks = ids, ranks
        d = tempfile.mkdtemp(prefix="zkvb-", dir="/tmp")
        front, back, self.pull_addr = f"ipc://{d}/f", f"ipc://{d}/b", f"ipc://{d}/p"
        mp = multiprocessing.get_context("spawn")
        ready = mp.Event()
        self.procs = [mp.Process(target=_relay_broker, args=(front, back, ranks, ready), daemon=True)]
        self.procs += [mp.Process(target=_relay_rank, args=(back,), daemon=True) for _ in range(ranks)]
        for p in self.procs:
            p.start()
        self.ctx = zmq.Context()
        self.dealer, self.pull = self.ctx.socket(zmq.DEALER), self.ctx.socket(zmq.PULL)
        for sock in (self.dealer, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self.pull_addr)
        self.dealer.connect(front)
        if not ready.wait(30):
            self.close()
            raise RuntimeError("raw relay did not start")
        self.pids = {
            "client": os.getpid(),
            "broker": self.procs[0].pid or 0,
            **{f"rank{r}": p.pid or 0 for r, p in enumerate(self.procs[1:])},
        }
        self.header = self.pull_addr.encode()
        self.body = P.encode_body("swap_out", list(range(ids)), list(range(ids)))

    def submit(self) -> None:
        self.dealer.send_multipart([self.header, self.body])

    def collect(self, _: Any) -> None:
        for _ in range(self.ranks):
            if not self.pull.poll(10_000):
                raise TimeoutError("raw relay lost a reply")
            self.pull.recv(zmq.NOBLOCK)

    def close(self) -> None:
        self.dealer.send_multipart([b"stop", b"stop"])
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        self.dealer.close()
        self.pull.close()
        self.ctx.term()


class ZkvBus:
    """zkv as a user runs it: ``zkv up``'s broker and rank processes, one client."""

    def __init__(self, ids: int, layout: CacheLayout, ranks: int = 2):
        from .cluster import LocalCluster

        rng = random.Random(1)
        self.cluster = LocalCluster(ranks, layout, quiet=True).start()
        self.client = self.cluster.client()
        self.body = P.encode_body(
            "swap_out", rng.sample(range(layout.gpu_blocks), ids), rng.sample(range(layout.cpu_blocks), ids)
        )
        self.bytes_per_task = ids * layout.block_bytes * ranks
        broker = self.cluster.broker
        self.pids = {
            "client": os.getpid(),
            "broker": broker.pid if broker else 0,
            **{f"rank{r}": w.pid for r, w in sorted(self.cluster.workers.items())},
        }

    def submit(self) -> int:
        return self.client.submit_raw(self.body)

    def collect(self, task: int) -> None:
        out = self.client.wait(task, timeout=30)
        if not out.ok:
            raise RuntimeError(f"benchmark task failed: {out}")

    def close(self) -> None:
        self.client.close()
        self.cluster.stop()


def bench_bus(ids: int, layout: CacheLayout, n_latency: int, n_tput: int, window: int = 64, rounds: int = 3) -> dict:
    """zkv beside the raw relay, measured in alternating rounds (relay, zkv,
    relay, zkv ...) so both see the same machine: the same task size, the
    same ``window`` in flight, the same number of tasks.  Throughput is the
    median over rounds, round trips are pooled."""
    relay, bus = RawRelay(ids), None
    try:
        bus = ZkvBus(ids, layout)
        runs: dict[str, list[dict]] = {"raw_pyzmq_relay": [], "zkv": []}
        for _ in range(rounds):
            for name, system in (("raw_pyzmq_relay", relay), ("zkv", bus)):
                runs[name].append(_measure(system.submit, system.collect, n_latency, n_tput, window, system.pids))
    finally:
        relay.close()
        if bus is not None:
            bus.close()
    out: dict[str, Any] = {}
    for name, results in runs.items():
        out[name] = {
            "tasks_per_s": statistics.median(r["tasks_per_s"] for r in results),
            "tasks_per_s_rounds": [r["tasks_per_s"] for r in results],
            "rtt_us": percentiles([x for r in results for x in r["rtt_samples_us"]], mean=True),
            "cpu_us_per_task": {
                p: round(statistics.median(r["cpu_us_per_task"][p] for r in results), 1)
                for p in results[0]["cpu_us_per_task"]
            },
        }
    out["zkv"]["bytes_per_task"] = bus.bytes_per_task
    z, r = out["zkv"], out["raw_pyzmq_relay"]
    out["vs_relay"] = {
        "throughput": z["tasks_per_s"] / r["tasks_per_s"],
        "rtt_p50": z["rtt_us"]["p50"] / r["rtt_us"]["p50"],
        "rtt_p99": z["rtt_us"]["p99"] / r["rtt_us"]["p99"],
        "cpu_per_task": sum(z["cpu_us_per_task"].values()) / max(1e-9, sum(r["cpu_us_per_task"].values())),
        "window": window,
        "rounds": rounds,
    }
    return out


# --- copy engine ---------------------------------------------------------------------


def bench_copy(layout: CacheLayout, blocks: int, repeats: int) -> dict:
    import torch

    from ...rank.store import BlockStore

    torch.set_num_threads(1)  # as a rank worker runs its copies
    cache = BlockStore.owned(layout, "cpu")
    rng = random.Random(2)
    scattered_src = rng.sample(range(layout.gpu_blocks), blocks)
    scattered_dst = rng.sample(range(layout.cpu_blocks), blocks)
    nbytes = blocks * layout.block_bytes

    def rate(fn: Callable[[], Any]) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9

    plain_src = torch.ones(nbytes, dtype=torch.uint8)
    plain_dst = torch.empty(nbytes, dtype=torch.uint8)

    def plain_contiguous() -> None:  # the same bytes, one contiguous copy_
        plain_dst.copy_(plain_src)

    si = torch.tensor(scattered_src)
    di = torch.tensor(scattered_dst)

    def gather_scatter() -> None:
        for g, c in zip(cache.views("gpu"), cache.views("cpu")):
            c.index_copy_(0, di, g.index_select(0, si))

    return {
        "bytes": nbytes,
        "baseline_plain_contiguous_copy_GBps": rate(plain_contiguous),
        "baseline_index_select_copy_GBps": rate(gather_scatter),
        "zkv_contiguous_ids_GBps": rate(lambda: cache.move("swap_out", range(blocks), range(blocks))),
        "zkv_scattered_ids_GBps": rate(lambda: cache.move("swap_out", scattered_src, scattered_dst)),
        "threads": torch.get_num_threads(),
    }


# --- pause / resume ------------------------------------------------------------------


def bench_attached_copy(blocks: int, repeats: int, copy_threads: int | None = None) -> dict:
    """The engine-attached copy engine (``zkv.harness.copies.bench``): a
    per-layer layout and a block-major one, contiguous and scattered ids,
    each beside a plain ``copy_`` of the same bytes timed interleaved;
    ``copy_threads`` for a large copy (None: what a rank here takes)."""
    from ..copies.bench import bench_copy as attached

    return attached(blocks=blocks, reps=repeats, copy_threads=copy_threads)


def bench_pause(layout: CacheLayout, cycles: int, inflight: int) -> dict:
    from .cluster import LocalCluster

    idle_pause, idle_resume, busy_pause, drains, overheads = [], [], [], [], []
    with LocalCluster(2, layout, quiet=True) as cluster, cluster.client() as client:
        for _ in range(cycles):
            t0 = time.perf_counter()
            client.pause()
            t1 = time.perf_counter()
            client.resume()
            idle_resume.append((time.perf_counter() - t1) * 1e3)
            idle_pause.append((t1 - t0) * 1e3)
        rng = random.Random(3)
        for _ in range(cycles):
            tasks = []
            for _ in range(inflight):
                k = 64
                tasks.append(
                    (
                        time.perf_counter(),
                        client.submit(
                            "swap_out", rng.sample(range(layout.gpu_blocks), k), rng.sample(range(layout.cpu_blocks), k)
                        ),
                    )
                )
            t0 = time.perf_counter()
            client.pause()
            t_reply = time.perf_counter()
            outs = [client.wait(t, timeout=30) for _, t in tasks]
            last_result = max(sub + out.elapsed_s for (sub, _), out in zip(tasks, outs))
            busy_pause.append((t_reply - t0) * 1e3)
            drains.append(max(0.0, last_result - t0) * 1e3)
            overheads.append((t_reply - max(t0, last_result)) * 1e3)
            client.resume()
    return {
        "idle_pause_ms": percentiles(idle_pause, mean=True),
        "idle_resume_ms": percentiles(idle_resume, mean=True),
        "busy_pause_ms": percentiles(busy_pause, mean=True),
        "busy_drain_ms": percentiles(drains, mean=True),
        "busy_overhead_beyond_drain_ms": percentiles(overheads, mean=True),
        "inflight_tasks": inflight,
    }
