"""``zkv bench store``: the keyed store through a real rank (``get`` tasks on a local
cluster: client, broker, the rank's store lane, the value checked, the CPU rows
written) beside a plain loop reading the same bytes straight from the same store
in the same run: redis-py ``GET``s of the same values for a Redis server the
bench starts on loopback, a read of each file for the host tier.  Rounds
alternate, after one unmeasured round; ``put`` is timed beside a plain ``SET``
/ file write the same way."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ...rank.tiers.store_tier import name_of
from ...testing.redis_server import REDIS, RedisServer
from ...wire.layout import CacheLayout
from .cluster import LocalCluster

LAYOUT = CacheLayout(layers=4, gpu_blocks=16, cpu_blocks=256, block_size=16, kv_heads=8, head_dim=128)  # 256 KiB
NS = "bench"
WINDOW = 4  # get tasks in flight
TARGET = 0.8  # zkv's get from Redis / a redis-py GET loop of the same bytes (the host tier's ratio is reported)


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(8, "little") for i in range(n)]


def _tasks(client: Any, op: str, per_task: int, tasks: int) -> float:
    """Seconds for ``tasks`` tasks of ``per_task`` blocks, ``WINDOW`` in flight; each must end ok."""
    keys = _keys(per_task * tasks)
    open_: list[int] = []
    t0 = time.perf_counter()
    for i in range(tasks):
        rows = list(range(i * per_task % LAYOUT.cpu_blocks, i * per_task % LAYOUT.cpu_blocks + per_task))
        src, dst = (rows, None) if op == "put" else (None, rows)
        open_.append(client.submit(op, src, dst, timeout=120, keys=keys[i * per_task : (i + 1) * per_task], ns=NS))
        if len(open_) >= WINDOW:
            out = client.wait(open_.pop(0))
            if not out.ok:
                raise RuntimeError(f"{op} ended {out.outcome}: {out.reason}")
    for task in open_:
        out = client.wait(task)
        if not out.ok:
            raise RuntimeError(f"{op} ended {out.outcome}: {out.reason}")
    return time.perf_counter() - t0


def _plain_redis(url_port: int, names: list[str]) -> Callable[[], tuple[float, float]]:
    import redis

    r = redis.Redis(port=url_port)
    values: list[Any] = list(r.mget(names))

    def round_() -> tuple[float, float]:
        t0 = time.perf_counter()
        for name, value in zip(names, values):
            r.set(name + ":plain", value)
        t1 = time.perf_counter()
        for name in names:
            r.get(name + ":plain")
        return t1 - t0, time.perf_counter() - t1

    return round_


def _plain_files(root: Path, names: list[str]) -> Callable[[], tuple[float, float]]:
    values = [_path(root, n).read_bytes() for n in names]
    out = root / "plain"
    out.mkdir(exist_ok=True)

    def round_() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i, value in enumerate(values):
            (out / str(i)).write_bytes(value)
        t1 = time.perf_counter()
        for i in range(len(values)):
            (out / str(i)).read_bytes()
        return t1 - t0, time.perf_counter() - t1

    return round_


def _path(root: Path, name: str) -> Path:
    _, ns, rank, key = name.split(":", 3)
    return root / ns / f"{rank}-{key}"


def _one(
    kind: str,
    url: str,
    plain: Callable[[list[str]], Callable[[], tuple[float, float]]],
    rounds: int,
    quick: bool,
    say: Any,
) -> dict[str, Any]:
    per_task, tasks = (16, 4) if quick else (16, 16)
    nbytes = LAYOUT.block_bytes * per_task * tasks
    cluster = LocalCluster(1, LAYOUT, quiet=True, worker_args=["--store", url])
    try:
        cluster.start(timeout=120)
        with cluster.client(request_timeout=60) as client:
            if not client.run("fill", None, list(range(LAYOUT.cpu_blocks)), tier="cpu", seed=1).ok:
                raise RuntimeError("fill failed")
            _tasks(client, "put", per_task, tasks)  # unmeasured: the values there once
            baseline = plain([name_of(NS, 0, k) for k in _keys(per_task * tasks)])
            baseline()
            zkv_put, zkv_get, plain_put, plain_get = [], [], [], []
            for _ in range(rounds):
                say(f"store ({kind}): a round of zkv put/get beside a plain loop ...")
                zkv_put.append(_tasks(client, "put", per_task, tasks))
                zkv_get.append(_tasks(client, "get", per_task, tasks))
                w, r = baseline()
                plain_put.append(w)
                plain_get.append(r)
    finally:
        cluster.stop()

    def rate(seconds: list[float]) -> float:
        return statistics.median(nbytes / t / 1e9 for t in seconds)

    res = {
        "store": kind,
        "bytes_per_round": nbytes,
        "blocks_per_task": per_task,
        "zkv_get_GBps": rate(zkv_get),
        "plain_get_GBps": rate(plain_get),
        "zkv_put_GBps": rate(zkv_put),
        "plain_put_GBps": rate(plain_put),
        "get_rounds_vs_plain": [round(p / z, 2) for z, p in zip(zkv_get, plain_get)],
    }
    res["get_vs_plain"] = rate(zkv_get) / rate(plain_get)
    res["put_vs_plain"] = rate(zkv_put) / rate(plain_put)
    return res


def bench_store(quick: bool = False, rounds: int = 3, say: Any = lambda m: None) -> dict[str, Any]:
    """The host tier and (when ``redis-server`` is installed) a Redis tier, each beside its plain loop."""
    work = Path(tempfile.mkdtemp(prefix="zkv-bench-store-", dir="/dev/shm"))
    out: dict[str, Any] = {"block_bytes": LAYOUT.block_bytes, "window": WINDOW, "target": TARGET}
    try:
        host = work / "host-tier"
        url = f"file://{host}?budget=1GiB"
        out["host_tier"] = _one("host tier", url, lambda names: _plain_files(host, names), rounds, quick, say)
        if REDIS is None:
            out["redis"] = {"skipped": "redis-server is not installed (bash tests/redis_setup.sh)"}
        else:
            server = RedisServer(work / "redis", maxmemory="1gb", timeout=5.0).start()
            try:
                out["redis"] = _one(
                    "redis", server.url, lambda names: _plain_redis(server.port, names), rounds, quick, say
                )
            finally:
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def summary(res: dict) -> str:
    lines = [f"keyed store ({res['block_bytes'] // 1024} KiB blocks, {res['window']} get tasks in flight):"]
    for name in ("host_tier", "redis"):
        r = res.get(name, {})
        if "skipped" in r:
            lines.append(f"  {name}: skipped ({r['skipped']})")
            continue
        if not r:
            continue
        held = "ok" if r["get_vs_plain"] >= res["target"] else "MISSED"
        goal = f"{held}: target >= {res['target']}x" if name == "redis" else "no target: a memcpy is the plain loop"
        rounds = r["get_rounds_vs_plain"]
        lines.append(
            f"  {r['store']}: zkv get {r['zkv_get_GBps']:.3f} GB/s  | plain read loop {r['plain_get_GBps']:.3f} GB/s"
            f"  ({r['get_vs_plain']:.2f}x [{min(rounds):.2f}-{max(rounds):.2f}]; {goal});"
            f"  put {r['zkv_put_GBps']:.3f} GB/s beside {r['plain_put_GBps']:.3f} ({r['put_vs_plain']:.2f}x)"
        )
    return "\n".join(lines)
