"""CPU per pause and per resume on a local bus (a broker, ``ranks`` rank
processes, this process as the client), process by process.

Each cycle times ``client.pause()`` and ``client.resume()`` on an idle bus
and books the CPU every thread of every bus process spent meanwhile
(``/proc/PID/task/*/schedstat``, to the nanosecond) and this process's own
CPU around the call (its reading of ``/proc`` left out).  The bus's idle CPU
(heartbeats, timers) per second is printed beside it.  Imports only absolute
``zkv`` names, so ``PYTHONPATH=OTHER_TREE python3 zkv/harness/bus/pause_cpu.py``
measures another tree with the same script.

``python -m zkv.harness.bus.pause_cpu [CYCLES]``; ``--against TREE`` runs two
buses at once, this tree's and ``TREE``'s (another checkout, e.g. main), each
driven by its own client process importing its own tree, and alternates
rounds of cycles between them: each round's figures beside the other tree's
taken in the same second, which is what a loaded 2-core machine allows."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zkv.harness.bus.cluster import LocalCluster
from zkv.obs.stats import thread_cpu_ns
from zkv.wire.layout import CacheLayout

SMALL = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=64, block_size=16, kv_heads=2, head_dim=64)


def _threads_ns(pids: dict[int, str]) -> dict[str, int]:
    """CPU ns per bus process, every thread summed."""
    out: dict[str, int] = {}
    for role_kind, ns in thread_cpu_ns(pids).items():
        who = role_kind.rsplit(" ", 1)[0]
        out[who] = out.get(who, 0) + ns
    return out


def measure(cycles: int = 300, ranks: int = 2, layout: CacheLayout = SMALL) -> dict[str, Any]:
    with LocalCluster(ranks, layout, quiet=True) as cluster, cluster.client() as client:
        assert cluster.broker is not None
        pids = {cluster.broker.pid: "broker", **{p.pid: f"rank{r}" for r, p in sorted(cluster.workers.items())}}
        for _ in range(10):  # connections made, first-epoch costs paid
            client.pause()
            client.resume()
        before, start = _threads_ns(pids), time.perf_counter()
        time.sleep(1.0)  # not a wait for an event: a one-second window of idle CPU, measured
        idle = {w: (n - before[w]) / (time.perf_counter() - start) / 1e6 for w, n in _threads_ns(pids).items()}
        books: dict[str, dict[str, int]] = {"pause": {}, "resume": {}}
        wall: list[float] = []
        for _ in range(cycles):
            for op, call in (("pause", client.pause), ("resume", client.resume)):
                a = _threads_ns(pids)
                mine, t = time.process_time_ns(), time.perf_counter()
                call()
                took, mine = time.perf_counter() - t, time.process_time_ns() - mine
                b = _threads_ns(pids)
                if op == "pause":
                    wall.append(took)
                book = books[op]
                for who in b:
                    book[who] = book.get(who, 0) + b[who] - a.get(who, b[who])
                book["client"] = book.get("client", 0) + mine
    per = {op: {who: ns / cycles / 1e6 for who, ns in book.items()} for op, book in books.items()}
    return {
        "cycles": cycles,
        "pause_p50_ms": statistics.median(wall) * 1e3,
        "cpu_ms": per,
        "cpu_ms_total": {op: sum(v.values()) for op, v in per.items()},
        "idle_cpu_ms_per_s": idle,
    }


def summary(r: dict[str, Any]) -> str:
    lines = [f"{r['cycles']} idle pause/resume cycles, pause p50 {r['pause_p50_ms']:.2f} ms"]
    for op in ("pause", "resume"):
        parts = ", ".join(f"{who} {ms:.3f}" for who, ms in r["cpu_ms"][op].items())
        lines.append(f"  CPU per {op}: {r['cpu_ms_total'][op]:.3f} ms ({parts})")
    lines.append("  idle CPU, ms per s: " + ", ".join(f"{w} {v:.1f}" for w, v in r["idle_cpu_ms_per_s"].items()))
    return "\n".join(lines)


def _serve(cycles_per_round: int) -> None:
    """A child of ``against``: one bus; a line on stdin runs a round, its figures go out as JSON."""
    with LocalCluster(2, SMALL, quiet=True) as cluster, cluster.client() as client:
        assert cluster.broker is not None
        pids = {cluster.broker.pid: "broker", **{p.pid: f"rank{r}" for r, p in sorted(cluster.workers.items())}}
        for _ in range(10):
            client.pause()
            client.resume()
        print(json.dumps({"ready": True}), flush=True)
        for _line in sys.stdin:
            book: dict[str, int] = {}
            for _ in range(cycles_per_round):
                a = _threads_ns(pids)
                mine = time.process_time_ns()
                client.pause()
                mine = time.process_time_ns() - mine
                b = _threads_ns(pids)
                for who in b:
                    book[who] = book.get(who, 0) + b[who] - a.get(who, b[who])
                book["client"] = book.get("client", 0) + mine
                client.resume()
            print(json.dumps({w: ns / cycles_per_round / 1e6 for w, ns in book.items()}), flush=True)


def against(other: str, rounds: int = 10, cycles: int = 50) -> dict[str, list[dict[str, float]]]:
    """CPU ms per pause by process, per round, for this tree and ``other``, rounds alternated."""
    here = str(Path(__file__).resolve().parents[2])
    kids = {}
    for name, tree in (("this tree", here), (other, other)):
        env = dict(os.environ, PYTHONPATH=tree)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(cycles)]
        kids[name] = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out: dict[str, list[dict[str, float]]] = {name: [] for name in kids}
    try:
        for kid in kids.values():
            assert kid.stdout is not None and json.loads(kid.stdout.readline()).get("ready")
        for i in range(rounds):
            for name in list(kids) if i % 2 == 0 else list(kids)[::-1]:
                kid = kids[name]
                assert kid.stdin is not None and kid.stdout is not None
                kid.stdin.write("go\n")
                kid.stdin.flush()
                out[name].append(json.loads(kid.stdout.readline()))
    finally:
        for kid in kids.values():
            if kid.stdin is not None:
                kid.stdin.close()
            kid.wait(timeout=60)
    return out


def against_summary(res: dict[str, list[dict[str, float]]]) -> str:
    lines = []
    for name, rounds in res.items():
        totals = [sum(r.values()) for r in rounds]
        who = {w: statistics.median(r[w] for r in rounds) for w in rounds[0]}
        lines.append(
            f"{name}: CPU per pause median {statistics.median(totals):.3f} ms (rounds {min(totals):.3f}-"
            f"{max(totals):.3f}); " + ", ".join(f"{w} {v:.3f}" for w, v in who.items())
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--against"]:
        print(against_summary(against(sys.argv[2], *(int(a) for a in sys.argv[3:5]))))
    else:
        print(summary(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 300)))
