"""Summary statistics of measured samples: the one percentile rule, shared by
the replay report and the benchmarks."""

from __future__ import annotations

import math
import statistics


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
    """utime + stime of a process, all its threads (Linux /proc; 10 ms ticks)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
