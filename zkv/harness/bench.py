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

import multiprocessing
import random
import tempfile
import time
from typing import Any, Callable

import zmq

from ..wire import protocol as P
from ..wire.layout import CacheLayout
from .stats import percentiles


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
        ev = dict(poller.poll(30_000))
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
    while d.poll(30_000):
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


def _measure(submit: Callable[[], Any], collect: Callable[[Any], None], n_latency: int, n_tput: int, window: int) -> dict:
    for _ in range(20):  # warm up connections and caches
        collect(submit())
    rtts = []
    for _ in range(n_latency):
        t0 = time.perf_counter()
        collect(submit())
        rtts.append((time.perf_counter() - t0) * 1e6)
    t0 = time.perf_counter()
    pending: list = []
    for _ in range(n_tput):
        pending.append(submit())
        if len(pending) >= window:
            collect(pending.pop(0))
    for h in pending:
        collect(h)
    elapsed = time.perf_counter() - t0
    return {"rtt_us": percentiles(rtts, mean=True), "tasks_per_s": n_tput / elapsed}


def bench_raw_relay(ids: int, n_latency: int, n_tput: int, window: int, ranks: int = 2) -> dict:
    d = tempfile.mkdtemp(prefix="zkvb-", dir="/tmp")
    front, back, pull_addr = f"ipc://{d}/f", f"ipc://{d}/b", f"ipc://{d}/p"
    mp = multiprocessing.get_context("spawn")
    ready = mp.Event()
    procs = [mp.Process(target=_relay_broker, args=(front, back, ranks, ready), daemon=True)]
    procs += [mp.Process(target=_relay_rank, args=(back,), daemon=True) for _ in range(ranks)]
    for p in procs:
        p.start()
    ctx = zmq.Context()
    dealer, pull = ctx.socket(zmq.DEALER), ctx.socket(zmq.PULL)
    for s in (dealer, pull):
        s.setsockopt(zmq.LINGER, 0)
    pull.bind(pull_addr)
    dealer.connect(front)
    try:
        if not ready.wait(30):
            raise RuntimeError("raw relay did not start")
        header = pull_addr.encode()
        body = P.encode_body("swap_out", list(range(ids)), list(range(ids)))

        def submit() -> None:
            dealer.send_multipart([header, body])

        def collect(_: Any) -> None:
            for _ in range(ranks):
                if not pull.poll(10_000):
                    raise TimeoutError("raw relay lost a reply")
                pull.recv(zmq.NOBLOCK)

        return _measure(submit, collect, n_latency, n_tput, window)
    finally:
        dealer.send_multipart([b"stop", b"stop"])
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        dealer.close()
        pull.close()
        ctx.term()


def bench_zkv_bus(ids: int, n_latency: int, n_tput: int, window: int, layout: CacheLayout, ranks: int = 2) -> dict:
    from .cluster import LocalCluster

    rng = random.Random(1)
    with LocalCluster(ranks, layout, quiet=True) as cluster, cluster.client() as client:
        src = rng.sample(range(layout.gpu_blocks), ids)
        dst = rng.sample(range(layout.cpu_blocks), ids)
        body = P.encode_body("swap_out", src, dst)

        def collect(task: int) -> None:
            out = client.wait(task, timeout=30)
            if not out.ok:
                raise RuntimeError(f"benchmark task failed: {out}")

        res = _measure(lambda: client.submit_raw(body), collect, n_latency, n_tput, window)
        res["bytes_per_task"] = ids * layout.block_bytes * ranks
        return res


# --- copy engine ---------------------------------------------------------------------


def bench_copy(layout: CacheLayout, blocks: int, repeats: int) -> dict:
    import torch

    from ..rank.cache.owned import KVCache

    torch.set_num_threads(1)  # as a rank worker runs its copies
    cache = KVCache(layout, "cpu")
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
        for g, c in zip(cache.gpu, cache.cpu):
            c.index_copy_(0, di, g.index_select(0, si))

    return {
        "bytes": nbytes,
        "baseline_plain_contiguous_copy_GBps": rate(plain_contiguous),
        "baseline_index_select_copy_GBps": rate(gather_scatter),
        "zkv_contiguous_ids_GBps": rate(lambda: cache.swap("swap_out", range(blocks), range(blocks))),
        "zkv_scattered_ids_GBps": rate(lambda: cache.swap("swap_out", scattered_src, scattered_dst)),
        "threads": torch.get_num_threads(),
    }


# --- pause / resume ------------------------------------------------------------------


def bench_attached_copy(blocks: int, repeats: int) -> dict:
    """The engine-attached copy engine (``zkv.rank.cache.bench_copy``): a
    per-layer layout and a block-major one, contiguous and scattered ids,
    each beside a plain ``copy_`` of the same bytes timed interleaved."""
    from ..rank.cache.bench_copy import bench_copy as attached

    return attached(blocks=blocks, reps=repeats)


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
                tasks.append((time.perf_counter(), client.submit("swap_out", rng.sample(range(layout.gpu_blocks), k), rng.sample(range(layout.cpu_blocks), k))))
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
