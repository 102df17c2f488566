"""A fleet of vLLM servers with zkv through RL cycles: the demo (``zkv up
--demo --engine vllm-servers``) and the benchmark (``zkv bench cycle``), on
random Llamas written here (docs/engine-vllm.md, "A fleet of vLLM servers").

The benchmark times one cycle (``ServerFleet.cycle``: every engine through
its steps at once, with the cycle's labels, staging and last looks) beside
the same HTTP calls and bus operations made one by one in a loop, the way
trainers fan them out today (``harness/cycle/bench.py``), alternated in the
same run on the same servers, quiet and loaded."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any, Callable

from ...client.client import Client
from ...cycle.http import VllmServer
from ...cycle.servers import ReloadWeights, ServerFleet, ServerSpec
from .output import ticking
from .rig import BLOCK_TOKENS, BusProbe, ModelShape, write_llama
from .servers import ServerProc, complete
from .shared_bench import store_counts, wait_grown


def _start(
    root: Path, model: str, n: int, say: Callable[[str], None], extra: dict[str, Any] | None = None
) -> list[ServerProc]:
    cores = os.cpu_count() or 1  # a core each, in turn: under vLLM's default binding servers starve each other
    servers = []
    for i in range(n):
        bind = {"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)}
        servers.append(ServerProc(f"engine-{i}", model, root, extra=dict(extra or {}), env=bind))
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


def _fetched(server: ServerProc, block_bytes: int) -> int:
    """Blocks ``server`` has fetched from the shared store so far."""
    return BusProbe(server.bus_dir).blocks_by_op(block_bytes).get("get", 0)


def _moves(servers: list[ServerProc], model: str, store: str, seed: int, say: Callable[[str], None]) -> bool:
    """A conversation's first turn on the first server, its next on the second: served from the
    host tier they share (blocks fetched), tokens equal to the second's own recompute."""
    shape, a, b = ModelShape(), servers[0], servers[1]
    rng = random.Random(seed)
    first = [rng.randrange(1, shape.vocab) for _ in range(400)]
    before = store_counts(store)
    reply = complete(a.url, model, first)
    want = len(first) // BLOCK_TOKENS - 1
    wait_grown(store, before, want)  # the first server puts its blocks in its scheduler's steps
    turn = first + reply + [rng.randrange(1, shape.vocab) for _ in range(40)]
    fetched = _fetched(b, shape.block_bytes())
    got = complete(b.url, model, turn)
    n = _fetched(b, shape.block_bytes()) - fetched
    same = [got] == recompute(b, [turn])
    say(
        f"  a conversation's next turn moved from {a.name} to {b.name}: {n} blocks served from the host tier,"
        f" tokens equal {b.name}'s own recompute: {same}"
    )
    return same and n >= want


def demo(say: Callable[[str], None] = print) -> bool:
    """Two servers sharing a host tier serve a chat, move a conversation from one to the other,
    and go through a cycle to new weights (after which they share again, under the cycle's
    label), one whose update fails on one server (rolled back) and one whose checkpoint is not
    there on one server (refused before anything paused); each report is printed, and the
    tokens are checked."""
    shape = ModelShape()
    rng = random.Random(3)
    prompts = [[rng.randrange(1, shape.vocab) for _ in range(400)] for _ in range(3)]
    ok = True
    with tempfile.TemporaryDirectory(prefix="zkv-servers-") as tmp:
        root = Path(tmp)
        w0, w1 = (write_llama(root / f"w{i}", shape, seed=i) for i in range(2))
        store = f"file://{root / 'host-tier'}?budget=256MiB"
        servers = _start(root, w0, 2, say, {"store": store, "weights_version": "w0"})
        try:
            for s in servers:
                say(f"  {s.name}: {s.url}, zkv bus {s.bus} (zkv status --broker {s.bus})")
            say(f"  a host tier shared by both: {store} (zkv store ls --store '{store}')")
            old = [[complete(s.url, w0, p) for p in prompts] for s in servers]
            say(f"served a chat of {len(prompts)} conversations on each server (weights w0)")
            ok &= _moves(servers, w0, store, 11, say)
            with _fleet(servers) as fleet:
                say("cycle 1: every server to the new weights w1")
                report = fleet.cycle("demo-1", ReloadWeights(w1), rollback=ReloadWeights(w0), new_label="w1")
                say(report.describe())
                new = [[complete(s.url, w0, p) for p in prompts] for s in servers]
                fresh = [recompute(s, prompts) for s in servers]
                same = report.outcome == "committed" and new == fresh and new != old
                say(f"  every server serves w1, tokens equal its recompute on w1: {same}")
                ok &= same
                say("  the servers share again under the cycle's label (one namespace for w1):")
                ok &= _moves(servers, w0, store, 12, say)
                say(
                    f"cycle 2: an attempt to go to w0 whose update fails on {servers[1].name} (a path that is"
                    " not there, given by a custom update that nothing can check before): it must roll back"
                )

                def update(server: VllmServer, timeout: float) -> None:
                    path = str(root / "missing") if server.url == servers[1].url else w0
                    server.reload_weights(path, timeout=timeout)

                report = fleet.cycle("demo-2", update, rollback=ReloadWeights(w1))
                say(report.describe())
                after = [[complete(s.url, w0, p) for p in prompts] for s in servers]
                held = report.outcome == "rolled_back" and after == new
                say(f"  rolled back: every server still serves w1, with the same tokens as before cycle 2: {held}")
                ok &= held
                say(f"cycle 3: to w0, with a checkpoint on {servers[1].name} that is not there: checked first")
                paths = {servers[0].name: ReloadWeights(w0), servers[1].name: ReloadWeights(str(root / "missing"))}
                report = fleet.cycle("demo-3", paths, rollback=ReloadWeights(w1))
                say(report.describe())
                refused = (
                    report.outcome == "refused" and [[complete(s.url, w0, p) for p in prompts] for s in servers] == new
                )
                say(f"  refused before any server paused; every server still serves w1: {refused}")
                ok &= refused
        finally:
            for s in servers:
                s.stop()
    say("all checks hold" if ok else "A CHECK FAILED")
    return ok


def bench_cycle(
    counts: tuple[int, ...] = (2, 4), rounds: int = 3, loaded: int = 1, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Per fleet size, quiet and with ``loaded`` CPU burners: the cycle beside the hand loop
    (``harness/cycle/bench.py``), median of ``rounds`` alternated rounds, on the same servers."""
    from ..cycle.bench import sizes

    shape = ModelShape()
    result: dict[str, Any] = {"rounds": rounds, "fleets": {}, "loaded_by": loaded}
    with tempfile.TemporaryDirectory(prefix="zkv-bench-cycle-") as tmp:
        root = Path(tmp)
        paths = [write_llama(root / f"w{i}", shape, seed=i) for i in range(2)]
        servers = _start(root, paths[0], max(counts), say)
        try:
            specs = [ServerSpec(s.name, s.url, s.bus) for s in servers]
            result["fleets"] = sizes(specs, paths, counts, rounds, loaded, say)
        finally:
            for s in servers:
                s.stop()
    return result


def summary(res: dict[str, Any]) -> str:
    from ..cycle.bench import fleet_lines

    lines = [f"One RL cycle over vLLM servers (reload_weights; median of {res['rounds']} alternated rounds):"]
    lines += fleet_lines(res["fleets"], {2: 1.0})
    for n, f in res["fleets"].items():
        slow = sorted(f["loaded"]["steps_ms"].items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"    {n} servers, loaded, slowest steps: " + ", ".join(f"{k} {v:.0f} ms" for k, v in slow))
    return "\n".join(lines)
