"""``zkv bench cycle``: one RL cycle (``zkv.cycle``) beside the same calls made
one by one, the way trainers fan them out today (the hand loop), on the same
servers in the same run, rounds alternated (docs/benchmarks.md, "RL cycles
over vLLM servers").  Over real vLLM servers (``harness/vllm/server_fleet.py``)
and over 2 to 64 stand-in servers (``standin.py``, in a process of their own):
the cycle's time and pause window (the longest any server served nothing)
beside the loop's, quiet and with CPU burners loading the machine; with one
of 64 servers hung, how long the other 63 take to serve again; one killed
after the commit, noticed behind and brought forward; a slow network."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ...client.client import Client
from ...cycle.http import VllmServer
from ...cycle.servers import ReloadWeights, ServerFleet, ServerSpec, reset_prefix_cache
from ...cycle.terms import Outcome
from .standin import write_weights


def hand_loop(specs: list[ServerSpec], path: str, timeout: float = 60.0) -> tuple[float, float]:
    """The cycle's calls one by one, phase by phase over the servers, as a trainer's loop makes them
    (no labels, no staging, no rollback): (seconds, pause window: the longest a server served nothing)."""
    apis = [VllmServer(s.url, timeout) for s in specs]
    clients = [Client(s.bus, request_timeout=timeout) for s in specs]
    t0 = time.perf_counter()
    stopped: list[float] = []
    window = 0.0
    try:
        for api in apis:
            stopped.append(time.perf_counter())
            api.pause("wait")
        for c in clients:
            c.pause(timeout=timeout)
        for api in apis:
            api.reload_weights(path)
        for c in clients:
            c.clear(timeout=timeout)
        for c in clients:
            c.resume(timeout=timeout)
        for api in apis:
            reset_prefix_cache(api, tries_s=10.0)
        for api, at in zip(apis, stopped):
            api.resume()
            window = max(window, time.perf_counter() - at)
    finally:
        for c in clients:
            c.close()
    return time.perf_counter() - t0, window


@contextmanager
def standins(n: int, root: Path, **config: Any) -> Iterator[tuple[list[ServerSpec], Callable[..., None]]]:
    """``n`` stand-in servers in a process of their own: their specs, and ``control(op, i, **kw)``."""
    args = [sys.executable, "-m", "zkv.harness.cycle.standin", str(n), str(root)]
    args += [f"{k}={v}" for k, v in config.items()]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        said = json.loads(proc.stdout.readline())
        specs = [ServerSpec(*s) for s in said["servers"]]

        def control(op: str, i: int = 0, **kw: Any) -> None:
            q = "&".join([f"i={i}", *(f"key={k}&value={v}" for k, v in kw.items())])
            urllib.request.urlopen(urllib.request.Request(f"{said['control']}/{op}?{q}", method="POST"), timeout=10)

        yield specs, control
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _burn(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


@contextmanager
def load(processes: int) -> Iterator[None]:
    """``processes`` CPU burners for the duration (a loaded machine, as other work makes it)."""
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    burners = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(processes)]
    for p in burners:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in burners:
            p.join(10)


def _rounds(specs: list[ServerSpec], paths: list[str], rounds: int, tag: str) -> dict[str, Any]:
    """``rounds`` alternated rounds of the cycle and the loop over ``specs``."""
    cycle_s, loop_s, cycle_w, loop_w, apply_s = [], [], [], [], []
    with ServerFleet(specs) as fleet:
        for r in range(rounds):
            path = paths[r % len(paths)]
            t0 = time.perf_counter()
            report = fleet.cycle(f"{tag}-{r}", ReloadWeights(path))
            cycle_s.append(time.perf_counter() - t0)
            if report.outcome is not Outcome.COMMITTED:
                raise RuntimeError(report.describe())
            cycle_w.append(report.pause_window_s)
            apply_s.append(max(s.seconds for s in report.steps if str(s.step) == "update"))
            seconds, window = hand_loop(specs, paths[(r + 1) % len(paths)])
            loop_s.append(seconds)
            loop_w.append(window)
    c, lo = statistics.median(cycle_s), statistics.median(loop_s)
    return {
        "cycle_ms": round(c * 1000, 1),
        "loop_ms": round(lo * 1000, 1),
        "cycle_vs_loop": c / lo,
        "cycle_runs_ms": [round(x * 1000) for x in cycle_s],
        "loop_runs_ms": [round(x * 1000) for x in loop_s],
        "pause_window_ms": round(statistics.median(cycle_w) * 1000, 1),
        "loop_pause_window_ms": round(statistics.median(loop_w) * 1000, 1),
        "slowest_apply_ms": round(statistics.median(apply_s) * 1000, 1),
        "steps_ms": {k: round(v * 1000, 1) for k, v in report.step_seconds().items()},
    }


def sizes(
    specs: list[ServerSpec], paths: list[str], counts: tuple[int, ...], rounds: int, loaded: int, say: Callable
) -> dict[int, Any]:
    """Per fleet size (the first ``n`` of ``specs``): the rounds quiet, then with ``loaded`` burners."""
    fleets: dict[int, Any] = {}
    for n in counts:
        quiet = _rounds(specs[:n], paths, rounds, f"quiet-{n}")
        with load(loaded):
            busy = _rounds(specs[:n], paths, rounds, f"loaded-{n}")
        fleets[n] = {"quiet": quiet, "loaded": busy}
        say(
            f"  {n} servers: cycle {quiet['cycle_ms']:.0f} ms, loop {quiet['loop_ms']:.0f} ms quiet;"
            f" {busy['cycle_ms']:.0f} / {busy['loop_ms']:.0f} ms loaded"
        )
    return fleets


def _hung(specs: list[ServerSpec], control: Callable[..., None], paths: list[str], budget: float) -> dict[str, Any]:
    """One of the servers hangs in its update (SIGSTOP-like): the others, each on its own, roll back and
    serve again; how long until the last of them serves, beside its budget."""
    victim = len(specs) // 2
    control("set", victim, apply_ms=2000)
    timer = threading.Timer(0.5, control, args=("hang", victim))
    timer.start()
    try:
        with ServerFleet(specs, call_timeout=budget) as fleet:
            report = fleet.cycle(
                "hung", ReloadWeights(paths[1]), rollback=ReloadWeights(paths[0]), deadline_s=6 * budget,
                budgets={s.name: budget for s in specs},
            )  # fmt: skip
    finally:
        timer.join()
        control("unhang", victim)
        control("set", victim, apply_ms=300)
    with ServerFleet(specs) as fleet:  # its own id again, once it answers: finished
        t0 = time.perf_counter()
        again = fleet.cycle("hung", ReloadWeights(paths[1]), rollback=ReloadWeights(paths[0]))
        again_s = time.perf_counter() - t0
    healthy = [e for n, e in report.engines.items() if n != specs[victim].name]
    back = max((e.paused_s or 0.0) for e in healthy)
    serving = sum(1 for e in healthy if str(e.state) == "serving" and not e.paused)
    return {
        "servers": len(specs),
        "outcome": str(report.outcome),
        "others_serving": serving,
        "others_back_within_ms": round(back * 1000, 1),
        "budget_ms": budget * 1000,
        "hung_reported": str(report.engines[specs[victim].name].state),
        "cycle_ms": round(report.seconds * 1000, 1),
        "deadline_ms": 6 * budget * 1000,
        "again": str(again.outcome),
        "again_ms": round(again_s * 1000, 1),
    }


def _killed(specs: list[ServerSpec], control: Callable[..., None], paths: list[str], root: Path) -> dict[str, Any]:
    """Killed after the commit and started again on its checkpoint: noticed behind, brought forward."""
    record = str(root / "fleet-version.json")
    victim = len(specs) - 1
    with ServerFleet(specs, record=record) as fleet:
        first = fleet.cycle("commit", ReloadWeights(paths[1]), rollback=ReloadWeights(paths[0]), new_label="w1")
        control("kill", victim)
        control("restart", victim)
        t0 = time.perf_counter()
        view = fleet.look()
        look_s = time.perf_counter() - t0
        again = fleet.cycle("commit", ReloadWeights(paths[1]), rollback=ReloadWeights(paths[0]), new_label="w1")
        after = fleet.look()
    return {
        "servers": len(specs),
        "first": str(first.outcome),
        "behind": view.behind,
        "look_ms": round(look_s * 1000, 1),
        "again": str(again.outcome),
        "again_ms": round(again.seconds * 1000, 1),
        "behind_after": after.behind,
    }


def bench_standins(
    counts: tuple[int, ...] = (2, 16, 64),
    rounds: int = 3,
    loaded: int = 2,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Per fleet size, quiet and loaded: the cycle beside the loop; then the fault runs at the largest."""
    result: dict[str, Any] = {"rounds": rounds, "fleets": {}, "loaded_by": loaded}
    with tempfile.TemporaryDirectory(prefix="zkv-bench-standins-") as tmp:
        root = Path(tmp)
        paths = [write_weights(root / f"w{i}", seed=i) for i in range(2)]
        with standins(max(counts), root / "servers", apply_ms=300, jitter=50) as (specs, control):
            result["fleets"] = sizes(specs, paths, counts, rounds, loaded, say)
            result["hung"] = _hung(specs, control, paths, budget=2.0)
            say(f"  one of {len(specs)} hung: the others back within {result['hung']['others_back_within_ms']:.0f} ms")
            result["killed"] = _killed(specs, control, paths, root)
            say(f"  one of {len(specs)} killed after the commit: behind {result['killed']['behind']}")
        slow_n = min(16, max(counts))
        with standins(slow_n, root / "slow", apply_ms=300, jitter=50, rtt_ms=20) as (specs, _):
            result["slow_network"] = {"servers": slow_n, "rtt_ms": 20, **_rounds(specs, paths, rounds, "slow")}
            say(f"  {slow_n} stand-ins, 20 ms per request: {result['slow_network']['cycle_vs_loop']:.2f}x the loop")
    return result


def fleet_lines(fleets: dict[Any, Any], goals: dict[int, float]) -> list[str]:
    """Per fleet size, quiet and loaded: the cycle beside the loop, its pause window beside the loop's
    and the slowest single server's apply, each against its goal."""
    lines = []
    for n, f in fleets.items():
        for when in ("quiet", "loaded"):
            x = f[when]
            target = goals.get(int(n))
            verdict = "" if target is None else (" ok" if x["cycle_vs_loop"] <= target else " MISSED")
            verdict += "" if target is None else f" (<= {target}x)"
            window = x["pause_window_ms"] / max(x["slowest_apply_ms"], 1e-9)
            lines.append(
                f"  {n:>2} servers {when:>6}: cycle {x['cycle_ms']:.0f} ms | hand loop {x['loop_ms']:.0f} ms"
                f" -> {x['cycle_vs_loop']:.2f}x{verdict}; pause window {x['pause_window_ms']:.0f} ms"
                f" (loop {x['loop_pause_window_ms']:.0f} ms) = {window:.2f}x the slowest apply"
                f" ({'ok' if window <= 1.2 else 'MISSED'}: <= 1.2x)"
            )
    return lines


def summary(res: dict[str, Any]) -> str:
    """The figures beside their goals (docs/benchmarks.md)."""
    lines = [f"RL cycles over stand-in vLLM servers (median of {res['rounds']} alternated rounds, same run):"]
    lines += fleet_lines(res["fleets"], {2: 1.0, 16: 0.3})
    h = res["hung"]
    ok = h["others_serving"] == h["servers"] - 1 and h["others_back_within_ms"] <= h["budget_ms"] + 1000
    lines.append(
        f"  one of {h['servers']} hung in its update: {h['others_serving']} others serving again within"
        f" {h['others_back_within_ms']:.0f} ms: the hung one's budget {h['budget_ms']:.0f} ms, then their own"
        f" rollback ({'ok' if ok else 'MISSED'}; the deadline was {h['deadline_ms']:.0f} ms); the hung one"
        f" reported {h['hung_reported']}; run again once it answers: {h['again']} in {h['again_ms']:.0f} ms"
    )
    k = res["killed"]
    lines.append(
        f"  one of {k['servers']} killed after the commit, restarted on its checkpoint: behind {k['behind']}"
        f" ({k['look_ms']:.0f} ms to see); the cycle run again: {k['again']} in {k['again_ms']:.0f} ms,"
        f" behind after: {k['behind_after']}"
    )
    s = res["slow_network"]
    lines.append(
        f"  {s['servers']} servers, {s['rtt_ms']} ms per request: cycle {s['cycle_ms']:.0f} ms | loop"
        f" {s['loop_ms']:.0f} ms -> {s['cycle_vs_loop']:.2f}x"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    counts = tuple(int(a) for a in sys.argv[1:]) or (2, 16, 64)
    out = bench_standins(counts, loaded=int(os.environ.get("ZKV_BENCH_LOAD", "2")))
    print(summary(out))
