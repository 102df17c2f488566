"""``zkv bench disk``: the disk tier through a real rank (``spill`` and
``load`` tasks on a local cluster) beside a plain sequential write and read
of the same bytes to a file in the same directory with the same flags
(O_DIRECT where the directory takes it, else buffered I/O; every write batch
ends with ``fdatasync``, as a spill does), in alternating rounds of one run,
after one unmeasured round that writes both files in full.

Beside the 1-block tasks it times a bare bus round trip in the same rounds:
a ``spill`` the rank refuses at its first check (a disk id out of range),
which takes the path of every task (client, broker, the rank's executor,
the result) and does no I/O, so that a 1-block figure dominated by the bus
says so."""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

from ...rank.tiers import disk_io
from ...wire.layout import CacheLayout
from .cluster import LocalCluster

LAYOUT = CacheLayout(layers=4, gpu_blocks=16, cpu_blocks=512, block_size=16, kv_heads=8, head_dim=128)  # 256 KiB
WINDOW = 8  # tasks in flight: the rank runs them back to back, as a plain loop would
# zkv / a plain file, each direction: large tasks near the disk's speed; a 1-block
# task also pays a bus round trip, which a plain pread / pwrite does not.
TARGETS = {"256_blocks": 0.9, "1_block": 0.5}
Pairs = Callable[[int], tuple[list[int], list[int]]]  # task i -> (src, dst)


class PlainFile:
    """The baseline: ``tasks`` batches of ``per_task`` blocks written (each batch then
    ``fdatasync``) and read back sequentially, in one file of the same directory with the
    same flags.  Its buffer holds random bytes, as the rank's blocks do, and the file
    is overwritten in place from round to round, as the disk tier's is."""

    def __init__(self, directory: str, direct: bool, block: int, per_task: int, tasks: int):
        self.path = os.path.join(directory, "baseline.dat")
        self.nbytes, self.tasks = block * per_task, tasks
        self.buf = disk_io.aligned(self.nbytes)
        self.buf[: self.nbytes] = random.Random(1).randbytes(self.nbytes)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        os.posix_fallocate(self.fd, 0, self.nbytes * tasks)

    def round(self) -> tuple[float, float]:
        """Seconds to write, then to read, every batch."""
        view = memoryview(self.buf)[: self.nbytes]
        t0 = time.perf_counter()
        for i in range(self.tasks):
            disk_io.pwrite_all(self.fd, [view], i * self.nbytes)
            os.fdatasync(self.fd)
        t1 = time.perf_counter()
        for i in range(self.tasks):
            disk_io.pread_all(self.fd, [view], i * self.nbytes)
        t2 = time.perf_counter()
        view.release()
        return t1 - t0, t2 - t1

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)
        self.buf.close()


def _run(client: Any, op: str, tasks: int, pairs: Pairs, ok: bool = True) -> float:
    """Seconds for ``tasks`` tasks, ``WINDOW`` in flight; each must end ok (or, ``ok=False``, failed)."""
    t0 = time.perf_counter()
    open_: list[int] = []

    def wait(task: int) -> None:
        out = client.wait(task)
        if out.ok != ok:
            raise RuntimeError(f"{op} ended {out.outcome}: {out.reason}")

    for i in range(tasks):
        src, dst = pairs(i)
        open_.append(client.submit(op, src, dst, timeout=120))
        if len(open_) >= WINDOW:
            wait(open_.pop(0))
    for task in open_:
        wait(task)
    return time.perf_counter() - t0


def _bare(client: Any, tasks: int, disk_blocks: int) -> float:
    """Seconds for ``tasks`` bare round trips: spills refused at their first check, no I/O."""
    return _run(client, "spill", tasks, lambda i: ([i % LAYOUT.cpu_blocks], [disk_blocks]), ok=False)


def _zkv(client: Any, per_task: int, tasks: int) -> tuple[float, float]:
    """Seconds to spill then load ``tasks`` tasks of ``per_task`` blocks through the rank."""
    cpu = LAYOUT.cpu_blocks

    def run(op: str, pairs: Pairs) -> float:
        return _run(client, op, tasks, pairs)

    def rows(i: int) -> list[int]:
        return [(i * per_task + k) % cpu for k in range(per_task)]

    def disk(i: int) -> list[int]:
        return [i * per_task + k for k in range(per_task)]

    write = run("spill", lambda i: (rows(i), disk(i)))
    read = run("load", lambda i: (disk(i), rows(i)))
    return write, read


def _rates(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    rates = [nbytes / t / 1e9 for t in seconds]
    return {"GBps": statistics.median(rates), "GBps_rounds": [round(r, 3) for r in rates]}


def bench_disk(directory: str = "/var/tmp", rounds: int = 5, quick: bool = False, say=lambda m: None) -> dict:
    """Disk tier bandwidth beside the plain file baseline, for 256-block and 1-block tasks
    (and the bare bus round trip beside the 1-block ones)."""
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
                bare: list[float] = []
                plain = PlainFile(work, direct, block, per, n)
                try:
                    plain.round()  # unmeasured: both files written once in full
                    _zkv(client, per, n)
                    for _ in range(rounds):
                        runs["plain_file"].append(plain.round())
                        runs["zkv"].append(_zkv(client, per, n))
                        if per == 1:
                            bare.append(_bare(client, n, disk_blocks))
                finally:
                    plain.close()
                nbytes = block * per * n
                res: dict[str, Any] = {"tasks": n, "bytes_per_round": nbytes}
                for system, times in runs.items():
                    w, r = _rates(nbytes, [t for t, _ in times]), _rates(nbytes, [t for _, t in times])
                    res[system] = {
                        "write_GBps": w["GBps"],
                        "read_GBps": r["GBps"],
                        "write_GBps_rounds": w["GBps_rounds"],
                        "read_GBps_rounds": r["GBps_rounds"],
                    }
                z, p = res["zkv"], res["plain_file"]
                res["vs_plain"] = {"write": z["write_GBps"] / p["write_GBps"], "read": z["read_GBps"] / p["read_GBps"]}
                res["target"] = TARGETS[name]
                res["vs_plain_rounds"] = {
                    op: [round(a / b, 2) for a, b in zip(z[f"{op}_GBps_rounds"], p[f"{op}_GBps_rounds"])]
                    for op in ("write", "read")
                }
                if bare:
                    # what the bus alone allows a 1-block task: one block per bare round trip
                    res["bare_round_trip_us"] = statistics.median(bare) / n * 1e6
                    res["bus_bound_GBps"] = _rates(nbytes, bare)["GBps"]
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
            rounds, target = r["vs_plain_rounds"], TARGETS[name]
            held = "ok" if min(vs["write"], vs["read"]) >= target else "MISSED"
            lines.append(
                f"  {name} tasks: zkv write {z['write_GBps']:.3f} GB/s read {z['read_GBps']:.3f} GB/s"
                f"  | plain file write {p['write_GBps']:.3f} GB/s read {p['read_GBps']:.3f} GB/s"
                f"  (write {vs['write']:.2f}x [{min(rounds['write']):.2f}-{max(rounds['write']):.2f}],"
                f" read {vs['read']:.2f}x [{min(rounds['read']):.2f}-{max(rounds['read']):.2f}];"
                f" {held}: target >= {target}x both ways)"
            )
            if "bare_round_trip_us" in r:
                lines.append(
                    f"    bare bus round trip {r['bare_round_trip_us']:.0f} us per task ({WINDOW} in flight):"
                    f" at most {r['bus_bound_GBps']:.3f} GB/s of 1-block tasks whatever the disk"
                )
    return "\n".join(lines)
