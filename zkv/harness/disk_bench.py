"""``zkv bench disk``: the disk tier through a real rank (``spill`` and
``load`` tasks on a local cluster) beside a plain sequential write and read
of the same bytes to a file in the same directory with the same flags
(O_DIRECT where the directory takes it, else buffered I/O; every write batch
ends with ``fdatasync``, as a spill does), in alternating rounds of one run."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

from ..rank.cache import disk_io
from ..wire.layout import CacheLayout
from .cluster import LocalCluster

LAYOUT = CacheLayout(layers=4, gpu_blocks=16, cpu_blocks=512, block_size=16, kv_heads=8, head_dim=128)  # 256 KiB
WINDOW = 8  # tasks in flight: the rank runs them back to back, as a plain loop would


def _baseline(directory: str, direct: bool, block: int, per_task: int, tasks: int) -> tuple[float, float]:
    """Seconds to write then read ``tasks`` batches of ``per_task`` blocks sequentially (plain file)."""
    path = os.path.join(directory, "baseline.dat")
    nbytes = block * per_task
    buf = disk_io.aligned(nbytes)
    buf[: min(nbytes, 1 << 20)] = os.urandom(min(nbytes, 1 << 20))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes * tasks)
        t0 = time.perf_counter()
        for i in range(tasks):
            disk_io.pwrite_all(fd, [memoryview(buf)[:nbytes]], i * nbytes)
            os.fdatasync(fd)
        t1 = time.perf_counter()
        for i in range(tasks):
            disk_io.pread_all(fd, [memoryview(buf)[:nbytes]], i * nbytes)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()
    return t1 - t0, t2 - t1


def _zkv(client: Any, per_task: int, tasks: int) -> tuple[float, float]:
    """Seconds to spill then load ``tasks`` tasks of ``per_task`` blocks through the rank."""
    cpu = LAYOUT.cpu_blocks

    def run(op: str, pairs: Callable[[int], tuple[list[int], list[int]]]) -> float:
        t0 = time.perf_counter()
        open_: list[int] = []
        for i in range(tasks):
            src, dst = pairs(i)
            open_.append(client.submit(op, src, dst, timeout=120))
            if len(open_) >= WINDOW:
                out = client.wait(open_.pop(0))
                if not out.ok:
                    raise RuntimeError(f"{op} failed: {out.reason}")
        for task in open_:
            out = client.wait(task)
            if not out.ok:
                raise RuntimeError(f"{op} failed: {out.reason}")
        return time.perf_counter() - t0

    def rows(i: int) -> list[int]:
        return [(i * per_task + k) % cpu for k in range(per_task)]

    def disk(i: int) -> list[int]:
        return [i * per_task + k for k in range(per_task)]

    write = run("spill", lambda i: (rows(i), disk(i)))
    read = run("load", lambda i: (disk(i), rows(i)))
    return write, read


def bench_disk(directory: str = "/var/tmp", rounds: int = 3, quick: bool = False, say=lambda m: None) -> dict:
    """Disk tier bandwidth beside the plain file baseline, for 256-block and 1-block tasks."""
    work = tempfile.mkdtemp(prefix="zkv-bench-disk-", dir=directory)
    direct = disk_io.direct_supported(work)
    block = LAYOUT.block_bytes
    shapes = {"256_blocks": (256, 2 if quick else 4), "1_block": (1, 50 if quick else 200)}
    disk_blocks = max(per * n for per, n in shapes.values())
    args = ["--disk-dir", os.path.join(work, "tier"), "--disk-blocks", str(disk_blocks)]
    cluster = LocalCluster(1, LAYOUT, quiet=True, worker_args=args)
    out: dict[str, Any] = {"directory": directory, "direct": direct, "block_bytes": block, "window": WINDOW}
    try:
        cluster.start(timeout=120)
        with cluster.client(request_timeout=60) as client:
            if not client.run("fill", None, list(range(LAYOUT.cpu_blocks)), tier="cpu", seed=1).ok:
                raise RuntimeError("fill failed")
            for name, (per, n) in shapes.items():
                say(f"disk: {per}-block tasks, zkv and a plain file in alternating rounds ...")
                runs: dict[str, list[tuple[float, float]]] = {"plain_file": [], "zkv": []}
                for _ in range(rounds):
                    runs["plain_file"].append(_baseline(work, direct, block, per, n))
                    runs["zkv"].append(_zkv(client, per, n))
                nbytes = block * per * n
                res: dict[str, Any] = {"tasks": n, "bytes_per_round": nbytes}
                for system, times in runs.items():
                    res[system] = {
                        "write_GBps": statistics.median(nbytes / w / 1e9 for w, _ in times),
                        "read_GBps": statistics.median(nbytes / r / 1e9 for _, r in times),
                        "write_GBps_rounds": [round(nbytes / w / 1e9, 3) for w, _ in times],
                        "read_GBps_rounds": [round(nbytes / r / 1e9, 3) for _, r in times],
                    }
                z, p = res["zkv"], res["plain_file"]
                res["vs_plain"] = {"write": z["write_GBps"] / p["write_GBps"], "read": z["read_GBps"] / p["read_GBps"]}
                out[name] = res
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def summary(res: dict) -> str:
    mode = "O_DIRECT" if res["direct"] else "buffered + fdatasync"
    lines = [f"disk tier in {res['directory']} ({mode}, {res['block_bytes'] // 1024} KiB blocks):"]
    for name in ("256_blocks", "1_block"):
        if name in res:
            r = res[name]
            z, p, vs = r["zkv"], r["plain_file"], r["vs_plain"]
            lines.append(
                f"  {name} tasks: zkv write {z['write_GBps']:.3f} GB/s read {z['read_GBps']:.3f} GB/s"
                f"  | plain file write {p['write_GBps']:.3f} GB/s read {p['read_GBps']:.3f} GB/s"
                f"  (write {vs['write']:.2f}x, read {vs['read']:.2f}x; target >= 0.9x)"
            )
    return "\n".join(lines)
