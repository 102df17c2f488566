"""``zkv bench fleet``: a fleet pause of ``buses`` buses (2 rank processes
each, on this machine) beside the slowest single bus's pause, measured in
the same rounds of the same run.  Each round times every bus's own pause
(one client per bus, one after the other, so nothing else runs) and a fleet
pause of all of them, in alternating order; the target is a fleet pause no
slower than 1.5x the slowest single pause (concurrency, not a loop: the
loop's sum is reported beside it)."""

from __future__ import annotations

import collections
import os
import statistics
import time
from typing import Any, Callable

from ...client.client import Client
from ...fleet import Fleet
from ...obs.stats import percentiles, thread_cpu_ns
from .rig import FleetRig

TARGET = 1.5  # fleet pause <= 1.5x the slowest single bus's pause


def _timed(call: Callable[[], Any], roles: dict[int, str], spent: collections.Counter[str]) -> float:
    """``call()``'s time in ms; the CPU ns it cost the bus processes (``roles``: pid -> broker
    or rank) and this one are added to ``spent`` by thread (``obs.stats.thread_cpu_ns``; this
    process: ``client main``, the caller's thread, and ``client other``, the fleet's bus
    threads and ZMQ's)."""
    buses = thread_cpu_ns(roles)
    mine, main = time.process_time_ns(), time.thread_time_ns()
    start = time.perf_counter()
    call()
    ms = (time.perf_counter() - start) * 1000
    main = time.thread_time_ns() - main
    mine = time.process_time_ns() - mine  # before this reads /proc, which costs it
    spent.update(thread_cpu_ns(roles))
    spent.subtract(buses)
    spent.update({"client main": main, "client other": mine - main})
    return ms


def bench_fleet(buses: int = 8, ranks: int = 2, rounds: int = 30, say: Callable[[str], None] = print) -> dict:
    say(f"fleet: starting {buses} buses of {ranks} ranks ...")
    with FleetRig(buses, ranks) as rig:
        say(f"fleet: {rounds} rounds of {buses} single pauses and one fleet pause ...")
        return measure(rig, rounds)


def measure(rig: FleetRig, rounds: int) -> dict:
    """The rounds on a started ``rig`` (every bus running; left running)."""
    clients = [Client(a, request_timeout=30) for a in rig.frontends]
    try:
        with Fleet(rig.frontends, timeout=30) as fleet:
            for _ in range(3):  # warm: connections made, threads started, first-epoch costs paid
                fleet.pause()
                fleet.resume()
                for c in clients:
                    c.pause()
                    c.resume()
            roles = {c.broker.pid: "broker" for c in rig.clusters if c.broker is not None}
            roles.update({w.pid: "rank" for c in rig.clusters for w in c.workers.values()})
            ranks = sorted({c.ranks for c in rig.clusters})
            return _rounds(fleet, clients, rounds, len(clients), ranks[0] if len(ranks) == 1 else ranks, roles)
    finally:
        for c in clients:
            c.close()


def _singles(clients: list[Client], roles: dict[int, str], spent: collections.Counter[str]) -> list[float]:
    """Each bus's own pause, one after the other (then its resume, untimed)."""
    out = []
    for c in clients:
        out.append(_timed(c.pause, roles, spent))
        c.resume()
    return out


def _fleet_pause(fleet: Fleet, roles: dict[int, str], spent: collections.Counter[str]) -> tuple[float, float]:
    """One fleet pause (then its resume, untimed): its time, and the last bus's ack within it."""
    ms = _timed(fleet.pause, roles, spent)
    report = fleet.last_report
    assert report is not None and report.ok
    slowest = report.slowest()
    fleet.resume()
    return ms, slowest.answer.at_ms if slowest is not None else ms


def _rounds(fleet: Fleet, clients: list[Client], rounds: int, buses: int, ranks: Any, roles: dict[int, str]) -> dict:
    fleet_ms, slowest_ms, loop_ms, ratios, slowest_in_fleet = [], [], [], [], []
    # CPU ns of the bus processes and this one, by thread, while pausing: all fleet pauses, all single ones
    fleet_ns: collections.Counter[str] = collections.Counter()
    single_ns: collections.Counter[str] = collections.Counter()
    for i in range(rounds):
        if i % 2:  # alternate which goes first
            singles = _singles(clients, roles, single_ns)
            f, last_ack = _fleet_pause(fleet, roles, fleet_ns)
        else:
            f, last_ack = _fleet_pause(fleet, roles, fleet_ns)
            singles = _singles(clients, roles, single_ns)
        fleet_ms.append(f)
        slowest_in_fleet.append(last_ack)
        slowest_ms.append(max(singles))
        loop_ms.append(sum(singles))
        ratios.append(f / max(singles))
    med_fleet, med_slowest = statistics.median(fleet_ms), statistics.median(slowest_ms)
    cores = len(os.sched_getaffinity(0))
    cpu_fleet = sum(fleet_ns.values()) / 1e6 / rounds
    return {
        "buses": buses,
        "ranks_per_bus": ranks,
        "rounds": rounds,
        "cores": cores,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "fleet_pause_ms": percentiles(fleet_ms, mean=True),
        "slowest_single_pause_ms": percentiles(slowest_ms, mean=True),
        "loop_of_single_pauses_ms": percentiles(loop_ms, mean=True),
        "slowest_bus_ack_in_fleet_ms": percentiles(slowest_in_fleet),
        "fleet_vs_slowest_single": round(med_fleet / med_slowest, 3),
        "fleet_vs_slowest_single_per_round_p50": round(statistics.median(ratios), 3),
        "fleet_vs_loop": round(med_fleet / statistics.median(loop_ms), 3),
        # The CPU the buses and this client spend on one fleet pause, and on one bus's pause alone;
        # spread over every core it is the least a concurrent fleet pause can take on this machine.
        "cpu_ms_per_fleet_pause": round(cpu_fleet, 3),
        "cpu_ms_per_single_pause": round(sum(single_ns.values()) / 1e6 / (rounds * buses), 3),
        # where a fleet pause's CPU goes, by process role and thread, most first
        "cpu_ms_per_fleet_pause_by_thread": {part: round(ns / 1e6 / rounds, 3) for part, ns in fleet_ns.most_common()},
        "cpu_floor_ms": round(cpu_fleet / cores, 3),
        "fleet_vs_cpu_floor": round(med_fleet / (cpu_fleet / cores), 3),
        "target": TARGET,
    }


def summary(res: dict) -> str:
    f, s, loop = res["fleet_pause_ms"], res["slowest_single_pause_ms"], res["loop_of_single_pauses_ms"]
    ratio = res["fleet_vs_slowest_single"]
    return "\n".join(
        [
            f"fleet pause of {res['buses']} buses ({res['ranks_per_bus']} ranks each), {res['rounds']} rounds:",
            f"  fleet pause            p50 {f['p50']:.2f} ms  p99 {f['p99']:.2f} ms  mean {f['mean']:.2f} ms",
            f"  slowest single pause   p50 {s['p50']:.2f} ms  p99 {s['p99']:.2f} ms  mean {s['mean']:.2f} ms"
            " (per round, the slowest of the buses paused one at a time)",
            f"  loop of single pauses  p50 {loop['p50']:.2f} ms (what pausing them one by one costs)",
            f"  fleet / slowest single: {ratio:.2f}x of the medians"
            f" ({'ok' if ratio <= res['target'] else 'MISSED'}: target <= {res['target']}x),"
            f" {res['fleet_vs_slowest_single_per_round_p50']:.2f}x per round (p50);"
            f" fleet / loop {res['fleet_vs_loop']:.2f}x",
            f"  CPU: {res['cpu_ms_per_fleet_pause']:.1f} ms per fleet pause (every bus process and the client),"
            f" {res['cpu_ms_per_single_pause']:.2f} ms per single pause; over {res['cores']} cores a fleet pause"
            f" needs at least {res['cpu_floor_ms']:.2f} ms: fleet / that floor {res['fleet_vs_cpu_floor']:.2f}x"
            f" (load average {res['load_average_1min']})",
            "  CPU per fleet pause by thread: "
            + ", ".join(f"{part} {ms:.2f}" for part, ms in res["cpu_ms_per_fleet_pause_by_thread"].items())
            + " ms",
        ]
    )
