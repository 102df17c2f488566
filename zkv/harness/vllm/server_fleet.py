"""A fleet of vLLM servers with zkv through RL cycles: the demo (``zkv up
--demo --engine vllm-servers``) and the benchmark (``zkv bench cycle``), on
random Llamas written here (docs/engine-vllm.md, "A fleet of vLLM servers").

The benchmark times one cycle (``ServerFleet.cycle``: every step on every
engine at once, plus the cycle's labels) beside the same HTTP calls and bus
operations made one by one in a loop, the way trainers fan them out today,
alternated in the same run on the same servers."""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ...client.client import Client
from ...engines.vllm.server import VllmServer
from ...engines.vllm.server_cycle import ReloadWeights, ServerFleet, ServerSpec, reset_prefix_cache
from .output import ticking
from .rig import ModelShape, write_llama
from .servers import ServerProc, complete


def _start(root: Path, model: str, n: int, say: Callable[[str], None]) -> list[ServerProc]:
    servers = [ServerProc(f"engine-{i}", model, root) for i in range(n)]
    say(
        f"starting {n} vLLM servers with zkv (python -m vllm.entrypoints.openai.api_server; their logs:"
        f" {root}/engine-N-server.log) ..."
    )
    for s in servers:
        s.start()
    with ticking("  starting the servers"):
        for s in servers:
            s.wait_ready()
    return servers


def _fleet(servers: list[ServerProc]) -> ServerFleet:
    return ServerFleet([ServerSpec(s.name, s.url, s.bus) for s in servers])


def recompute(server: ServerProc, prompts: list[list[int]]) -> list[list[int]]:
    """The server's own recompute: its bus paused, its caches reset."""
    with Client(server.bus, request_timeout=30) as c:
        c.pause(timeout=30)
        try:
            if not VllmServer(server.url).reset_prefix_cache():
                raise RuntimeError(f"{server.name} refused to reset its prefix cache (blocks held)")
            return [complete(server.url, server.model, p) for p in prompts]
        finally:
            c.resume(timeout=30)


def demo(say: Callable[[str], None] = print) -> bool:
    """Two servers serve a chat, go through a cycle to new weights and one whose update fails
    on one server; every step per engine is printed, and the tokens are checked."""
    shape = ModelShape()
    rng = random.Random(3)
    prompts = [[rng.randrange(1, shape.vocab) for _ in range(400)] for _ in range(3)]
    ok = True
    with tempfile.TemporaryDirectory(prefix="zkv-servers-") as tmp:
        root = Path(tmp)
        w0, w1 = (write_llama(root / f"w{i}", shape, seed=i) for i in range(2))
        servers = _start(root, w0, 2, say)
        try:
            for s in servers:
                say(f"  {s.name}: {s.url}, zkv bus {s.bus} (zkv status --broker {s.bus})")
            old = [[complete(s.url, w0, p) for p in prompts] for s in servers]
            say(f"served a chat of {len(prompts)} conversations on each server (weights w0)")
            with _fleet(servers) as fleet:
                say("cycle 1: every server to the new weights w1")
                report = fleet.cycle("demo-1", ReloadWeights(w1), rollback=ReloadWeights(w0), new_label="w1")
                say(report.describe())
                new = [[complete(s.url, w0, p) for p in prompts] for s in servers]
                fresh = [recompute(s, prompts) for s in servers]
                same = report.outcome == "committed" and new == fresh and new != old
                say(f"  every server serves w1, tokens equal its recompute on w1: {same}")
                ok &= same
                say(f"cycle 2: back to w0, with the update failing on {servers[1].name} (a path that is not there)")

                def update(server: VllmServer, timeout: float) -> None:
                    path = str(root / "missing") if server.url == servers[1].url else w0
                    server.reload_weights(path, timeout=timeout)

                report = fleet.cycle("demo-2", update, rollback=ReloadWeights(w1))
                say(report.describe())
                after = [[complete(s.url, w0, p) for p in prompts] for s in servers]
                held = report.outcome == "rolled_back" and after == new
                say(f"  rolled back: every server serves w1 again with the same tokens: {held}")
                ok &= held
        finally:
            for s in servers:
                s.stop()
    say("all checks hold" if ok else "A CHECK FAILED")
    return ok


def _loop(servers: list[ServerProc], path: str, timeout: float = 60.0) -> None:
    """The cycle's calls one by one, as a trainer's loop makes them (no labels, no rollback)."""
    apis = [VllmServer(s.url, timeout) for s in servers]
    clients = [Client(s.bus, request_timeout=timeout) for s in servers]
    try:
        for api in apis:
            api.pause("wait")
        for c in clients:
            c.pause(timeout=timeout)
        for c in clients:
            c.clear(keep_cpu=True, timeout=timeout)
        for api in apis:
            api.reload_weights(path)
        for c in clients:
            c.resume(timeout=timeout)
        for c in clients:
            c.pause(timeout=timeout)
        for c in clients:
            c.clear(timeout=timeout)
        for c in clients:
            c.resume(timeout=timeout)
        for api in apis:
            reset_prefix_cache(api, tries_s=10.0)
        for api in apis:
            api.resume()
    finally:
        for c in clients:
            c.close()


def bench_cycle(
    counts: tuple[int, ...] = (2, 4), rounds: int = 3, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Per fleet size: the cycle's time and the loop's, median of ``rounds`` alternated runs."""
    shape = ModelShape()
    result: dict[str, Any] = {"rounds": rounds, "fleets": {}}
    with tempfile.TemporaryDirectory(prefix="zkv-bench-cycle-") as tmp:
        root = Path(tmp)
        w0 = write_llama(root / "w0", shape, seed=0)
        servers = _start(root, w0, max(counts), say)
        try:
            for n in counts:
                part = servers[:n]
                cycle_s, loop_s = [], []
                with _fleet(part) as fleet:
                    for r in range(rounds):
                        t0 = time.perf_counter()
                        report = fleet.cycle(f"bench-{n}-{r}", ReloadWeights(w0))
                        cycle_s.append(time.perf_counter() - t0)
                        if report.outcome != "committed":
                            raise RuntimeError(report.describe())
                        t0 = time.perf_counter()
                        _loop(part, w0)
                        loop_s.append(time.perf_counter() - t0)
                c, lo = statistics.median(cycle_s), statistics.median(loop_s)
                result["fleets"][n] = {
                    "cycle_ms": round(c * 1000, 1),
                    "loop_ms": round(lo * 1000, 1),
                    "cycle_vs_loop": c / lo,
                    "cycle_runs_ms": [round(x * 1000, 1) for x in cycle_s],
                    "loop_runs_ms": [round(x * 1000, 1) for x in loop_s],
                    "steps_ms": {k: round(v * 1000, 1) for k, v in report.step_seconds().items()},
                }
                runs = ", ".join(f"{a * 1000:.0f}/{b * 1000:.0f}" for a, b in zip(cycle_s, loop_s))
                say(f"  {n} servers: cycle {c * 1000:.0f} ms, loop {lo * 1000:.0f} ms (per round: {runs} ms)")
        finally:
            for s in servers:
                s.stop()
    return result


def summary(res: dict[str, Any]) -> str:
    lines = [f"One RL cycle over vLLM servers (reload_weights of the same checkpoint; median of {res['rounds']}):"]
    for n, f in res["fleets"].items():
        verdict = "ok" if f["cycle_vs_loop"] <= 1.2 else "MISSED"
        lines.append(
            f"  {n} servers: zkv cycle {f['cycle_ms']:.0f} ms | the same calls one by one {f['loop_ms']:.0f} ms"
            f" -> {f['cycle_vs_loop']:.2f}x ({verdict}: target <= 1.2x)"
        )
        slow = sorted(f["steps_ms"].items(), key=lambda kv: -kv[1])[:3]
        lines.append("    slowest steps: " + ", ".join(f"{k} {v:.0f} ms" for k, v in slow))
    return "\n".join(lines)
