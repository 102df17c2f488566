"""Summary statistics of measured samples: the one percentile rule, shared by
the replay report and the benchmarks, and the CPU processes spent."""

from __future__ import annotations

import collections
import math
import statistics
from pathlib import Path
from typing import Mapping


def percentiles(values: list[float], *, mean: bool = False) -> dict[str, float]:
    """n, p50, p99 and max (nearest rank), and the mean if asked, rounded to
    3 decimals (microseconds for values in ms); ``{"n": 0}`` for no values."""
    if not values:
        return {"n": 0}
    v = sorted(values)

    def at(p: float) -> float:
        return round(v[max(0, math.ceil(p / 100 * len(v)) - 1)], 3)

    out = {"n": len(v), "p50": at(50), "p99": at(99), "max": round(v[-1], 3)}
    if mean:
        out["mean"] = round(statistics.fmean(v), 3)
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, every live thread, to the nanosecond (``thread_cpu_ns``);
    utime + stime in 10 ms ticks (``/proc/PID/stat``) where a kernel keeps no schedstat."""
    import os

    ns = sum(thread_cpu_ns({pid: ""}).values())
    if ns:
        return ns / 1e9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_ns(roles: Mapping[int, str]) -> collections.Counter[str]:
    """CPU ns of every thread of the processes ``roles`` names (pid -> its role), to the
    nanosecond (``/proc/PID/task/*/schedstat``: ``/proc/PID/stat`` counts 10 ms ticks,
    coarser than a pause), summed per ``"ROLE KIND"``: KIND ``main`` (the thread the
    process started with), ``zmq-io`` (libzmq's I/O threads) or ``other`` (a rank's
    executor, a broker's state-file sync: Python names no OS thread)."""
    out: collections.Counter[str] = collections.Counter()
    for pid, role in roles.items():
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue  # a process that just ended
        for task in tasks:
            try:
                ns = int((task / "schedstat").read_text().split()[0])
                comm = (task / "comm").read_text()
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
            kind = "main" if task.name == str(pid) else "zmq-io" if comm.startswith("ZMQbg") else "other"
            out[f"{role} {kind}"] += ns
    return out
