"""A real transformers model (random Llama, nothing downloaded) keeps generating
bit for bit after its KV blocks were copied out, overwritten, and copied back
into other block ids of the engine's own cache; and survives the RL cycle.
Copies here are plain torch copies: this tests the engine side of the attach."""

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch_threads import one_torch_thread  # noqa: E402, F401  (autouse: one torch thread here)

from zkv.engines.transformers.build import PINNED_VERSION, build_manager  # noqa: E402
from zkv.engines.transformers.engine import (  # noqa: E402
    CacheFull,
    EngineNotQuiescent,
    NoFreeBlocks,
    TransformersCBEngine,
)

if transformers.__version__ != PINNED_VERSION:
    pytest.skip(f"needs transformers=={PINNED_VERSION}", allow_module_level=True)

BLOCK = 16


PROMPT, TURN1, USER2, TURN2 = 40, 12, 12, 10  # 40 + 12 - 1 = 51 KV tokens: 3 full blocks and a partial one


def llama(seed: int, dtype: torch.dtype = torch.float32) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=1024,
        initializer_range=0.2,  # the default 0.02 makes a random model repeat one token
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_for(model, num_blocks: int = 32, prefix_sharing: bool = True) -> TransformersCBEngine:
    return TransformersCBEngine(
        build_manager(model, num_blocks=num_blocks, block_size=BLOCK, prefix_sharing=prefix_sharing)
    )


def run(engine: TransformersCBEngine, request_id: str):
    engine.run_until_idle()
    out = engine.result(request_id)
    assert out is not None and out.error is None, out
    return out.generated_tokens, out.logprobs


def first_turn(engine: TransformersCBEngine):
    engine.submit("chat", tokens(1, PROMPT), max_new_tokens=TURN1)
    return run(engine, "chat")


def second_turn(engine: TransformersCBEngine) -> tuple[bool, tuple]:
    reused = engine.continue_request("chat", tokens(2, USER2), max_new_tokens=TURN2)
    return reused, run(engine, "chat")


def garbage_like(rows: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Plausible KV values (no NaNs), not the right ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows.numel() // dtype.itemsize, generator=g).to(dtype).view(torch.uint8).view(rows.shape)


def take_disjoint(engine: TransformersCBEngine, count: int, avoid: list[int]) -> list[int]:
    """Fresh blocks none of which is in ``avoid`` (the pool likes to hand freed ids straight back)."""
    held, blocks = [], engine.take_blocks(count)
    while set(blocks) & set(avoid):
        held += blocks
        blocks = engine.take_blocks(count)
    if held:
        engine.return_blocks(held)
    return blocks


def swap_out_and_in(engine: TransformersCBEngine, dtype: torch.dtype, copy_back: bool = True) -> torch.Tensor:
    """Swap "chat" out to a CPU tensor, overwrite its blocks, swap it into other ids; return the pre-swap bytes."""
    rows = engine.block_rows()
    old = engine.block_table("chat")
    cpu = rows.index_select(0, torch.tensor(old)).clone()  # the swap-out
    released = engine.release_blocks("chat")
    assert released == old
    rows.index_copy_(0, torch.tensor(old), garbage_like(cpu, dtype, seed=7))
    new = take_disjoint(engine, engine.blocks_needed("chat"), avoid=old)
    rows.index_copy_(0, torch.tensor(new), garbage_like(cpu, dtype, seed=8))
    if copy_back:
        rows.index_copy_(0, torch.tensor(new), cpu)  # the swap-in
    engine.install_block_table("chat", new)
    assert engine.block_table("chat") == new
    return cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swap_into_other_blocks_continues_bit_for_bit(dtype):
    model = llama(0, dtype)
    baseline = engine_for(model)
    turn1 = first_turn(baseline)
    reused, expected = second_turn(baseline)
    assert reused

    engine = engine_for(model)
    assert first_turn(engine) == turn1
    conv = engine.conversation("chat")
    assert conv.resident and conv.kv_len == PROMPT + TURN1 - 1
    pre = swap_out_and_in(engine, dtype)
    rows = engine.block_rows()
    assert torch.equal(rows.index_select(0, torch.tensor(engine.block_table("chat"))), pre)
    assert second_turn(engine) == (True, expected)

    control = engine_for(model)
    first_turn(control)
    swap_out_and_in(control, dtype, copy_back=False)
    reused, got = second_turn(control)
    assert reused and got != expected


def test_release_leaves_blocks_another_request_shares():
    model = llama(0)
    baseline = engine_for(model)
    first_turn(baseline)
    _, expected = second_turn(baseline)
    baseline.submit("peer", tokens(1, PROMPT), max_new_tokens=4)
    peer_alone = run(baseline, "peer")

    engine = engine_for(model)
    first_turn(engine)
    engine.submit("peer", tokens(1, PROMPT), max_new_tokens=4)  # prefix-matches chat's full blocks
    assert run(engine, "peer") == peer_alone
    old = engine.block_table("chat")
    shared = set(old) & set(engine.block_table("peer"))
    assert len(shared) == (PROMPT - 1) // BLOCK
    rows = engine.block_rows()
    cpu = rows.index_select(0, torch.tensor(old))
    free_before = engine.free_block_count()
    engine.release_blocks("chat")
    assert engine.free_block_count() == free_before + len(old) - len(shared)  # peer still holds the shared ones
    new = take_disjoint(engine, len(old), avoid=old)
    rows.index_copy_(0, torch.tensor(new), cpu)
    engine.install_block_table("chat", new)
    assert second_turn(engine) == (True, expected)
    assert set(engine.block_table("peer")) >= shared
    assert torch.equal(rows.index_select(0, torch.tensor(sorted(shared))), cpu[[old.index(b) for b in sorted(shared)]])


def test_block_order_error_shows_in_the_bytes():
    """Two full blocks exchanged barely move the logits, so order is checked on the bytes."""
    engine = engine_for(llama(0))
    first_turn(engine)
    rows = engine.block_rows()
    table = engine.block_table("chat")
    pre = rows.index_select(0, torch.tensor(table))
    swapped = [table[1], table[0]] + table[2:]
    assert not torch.equal(rows.index_select(0, torch.tensor(swapped)), pre)


def test_layout_describes_the_engine_tensor():
    model = llama(0)
    engine = engine_for(model)
    first_turn(engine)
    layout = engine.layout
    assert (layout.layers, layout.block_size, layout.kv_heads, layout.head_dim) == (4, BLOCK, 4, 32)
    assert layout.dtype == torch.float32 and layout.generation == 0
    assert layout.num_blocks * layout.block_bytes == engine.cache_tensor.numel()
    assert engine.cache_tensor.dtype == torch.uint8 and layout.scratch_blocks == 2
    table = engine.block_table("chat")
    assert all(layout.scratch_blocks <= b < layout.num_blocks for b in table)
    # The engine's own per-layer page views agree with the block-major description
    allocator = engine._allocator()
    typed = layout.typed(engine.cache_tensor)
    for layer in range(layout.layers):
        k_pages, v_pages = allocator.get_cache_for_block_table(layer)
        for b in table:
            assert torch.equal(typed[b, layer, 0], k_pages[2 * layout.layers * b])
            assert torch.equal(typed[b, layer, 1], v_pages[2 * layout.layers * b])
    assert typed[table[0], 0, 0].abs().sum() > 0  # real KV, not the zeroed allocation


def test_failed_swap_in_falls_back_to_recompute_exactly():
    model = llama(0)
    engine = engine_for(model)
    turn1 = first_turn(engine)
    engine.release_blocks("chat")  # swapped out; the swap-in below fails
    free_before = engine._cache().pool.count_free_blocks(0), engine._cache().pool.num_free_sectors
    engine.return_blocks(engine.take_blocks(engine.blocks_needed("chat")))
    assert (engine._cache().pool.count_free_blocks(0), engine._cache().pool.num_free_sectors) >= free_before
    reused, got = second_turn(engine)
    assert not reused

    fresh = engine_for(model)
    fresh.submit("chat", tokens(1, PROMPT) + turn1[0] + tokens(2, USER2), max_new_tokens=TURN2)
    assert got == run(fresh, "chat")


def test_take_blocks_refuses_more_than_the_pool_has():
    engine = engine_for(llama(0), num_blocks=8)
    with pytest.raises(NoFreeBlocks, match="evict_prefix_cache"):
        engine.take_blocks(9)
    blocks = engine.take_blocks(8)
    with pytest.raises(ValueError, match="take_blocks"):
        engine.return_blocks([blocks[0], 1])
    engine.return_blocks(blocks)


def test_parked_conversations_filling_the_cache_stop_the_engine_until_one_is_swapped_out():
    engine = engine_for(llama(0), num_blocks=8)
    for seed, name in enumerate(("a", "b")):  # 51 KV tokens each: 4 blocks each, the whole cache
        engine.submit(name, tokens(11 + seed, PROMPT), max_new_tokens=TURN1)
        run(engine, name)
    assert engine.free_block_count() == 0
    engine.submit("c", tokens(9, 8), max_new_tokens=4, keep=False)
    with pytest.raises(CacheFull, match="2 parked"):
        engine.step()
    engine.release_blocks("a")  # the swap-out a policy does for an idle conversation
    assert engine.free_block_count() == 4
    run(engine, "c")
    assert engine.conversation("b").resident


def test_evict_prefix_cache_returns_cached_blocks():
    engine = engine_for(llama(0))
    engine.submit("once", tokens(3, PROMPT), max_new_tokens=4, keep=False)
    run(engine, "once")
    assert engine.evict_prefix_cache() == PROMPT // BLOCK  # its full blocks were kept for prefix reuse
    assert engine.evict_prefix_cache() == 0


def test_rl_cycle_frees_the_cache_and_resumes_on_new_weights():
    model = llama(0)
    engine = engine_for(model)
    turn1 = first_turn(engine)
    storage = StorageWeakRef(engine.cache_tensor.untyped_storage())
    engine.clear()
    assert storage.expired()  # nobody, zkv included, holds a view of the old cache
    assert not engine.conversation("chat").resident

    weights_b = llama(1).state_dict()
    model.load_state_dict(weights_b)
    layout = engine.rebuild()
    assert layout.generation == 1
    engine.submit("new", tokens(4, PROMPT), max_new_tokens=TURN1)
    got_new = run(engine, "new")
    reused, got_chat = second_turn(engine)
    assert not reused  # KV made with the old weights is gone: the turn is recomputed

    fresh = engine_for(llama(1))
    fresh.submit("new", tokens(4, PROMPT), max_new_tokens=TURN1)
    assert got_new == run(fresh, "new")
    fresh.submit("chat", tokens(1, PROMPT) + turn1[0] + tokens(2, USER2), max_new_tokens=TURN2)
    assert got_chat == run(fresh, "chat")


def test_the_rank_on_the_engine_announces_its_layout_and_refuses_its_scratch_rows(tmp_path):
    """docs/engines.md, "Reserved rows": the adapter declares the scratch rows,
    so a task naming one fails naming the block; status shows the engine's layout."""
    import threading

    from zkv.broker.core import BrokerConfig
    from zkv.broker.loop import Broker
    from zkv.client.client import Client
    from zkv.engines.transformers import attach
    from zkv.engines.transformers.layout import model_layout
    from zkv.net.endpoints import Endpoints

    engine = engine_for(llama(0), num_blocks=16)
    layout = engine.layout
    ep = Endpoints.in_dir(tmp_path)
    broker = Broker(ep, BrokerConfig(world=1, heartbeat_ms=100))
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    agent = attach.start_rank(engine, 0, 1, ep, 8)
    try:
        with Client(ep.frontend) as c:
            shown = c.status(timeout=10).layout
            assert shown == model_layout(layout, 8) and shown.block_bytes == layout.block_bytes
            assert shown.gpu_blocks == layout.num_blocks and layout.scratch_blocks == 2
            for block in range(layout.scratch_blocks):
                out = c.run("swap_in", [0], [block], timeout=30)
                assert out.outcome == "failed" and f"dst block id {block} is reserved" in out.reason, out
            out = c.run("swap_out", [1], [0], timeout=30)
            assert out.outcome == "failed" and "src block id 1 is reserved" in out.reason, out
            (free,) = engine.take_blocks(1)
            assert c.run("swap_out", [free], [0], timeout=30).ok and c.run("swap_in", [0], [free], timeout=30).ok
            engine.return_blocks([free])
    finally:
        attach.stop_rank(agent)
        broker.stop()
        thread.join(timeout=10)


def test_swap_while_transformers_loop_thread_runs():
    model = llama(0)
    baseline = engine_for(model)
    first_turn(baseline)
    _, expected = second_turn(baseline)

    manager = build_manager(model, num_blocks=32, block_size=BLOCK)
    engine = TransformersCBEngine(manager)
    engine.submit("early", tokens(5, 20), max_new_tokens=2)
    engine.run_until_idle()
    assert engine.conversation("early").resident
    manager.start()  # transformers resets its block tables here
    try:
        assert engine.result("early", timeout=5) is not None
        engine.submit("chat", tokens(1, PROMPT), max_new_tokens=TURN1)
        assert engine.result("chat", timeout=30) is not None
        with pytest.raises(EngineNotQuiescent):
            engine.block_table("chat")
        with engine.paused():
            assert not engine.conversation("early").resident  # so "early" will recompute
            swap_out_and_in(engine, torch.float32)
            assert engine.continue_request("chat", tokens(2, USER2), max_new_tokens=TURN2)
        out = engine.result("chat", timeout=30)
        assert out is not None and (out.generated_tokens, out.logprobs) == expected
    finally:
        manager.stop(block=True, timeout=30)


TP_WORKER = """
import json, os, sys
import torch, transformers
sys.path[:0] = [{root!r}, {tests!r}]
torch.set_num_threads(1)
from zkv.engines.transformers.build import build_manager
from zkv.engines.transformers.engine import TransformersCBEngine
from test_engine_transformers import first_turn, second_turn, swap_out_and_in, tokens, USER2, TURN2
model = transformers.LlamaForCausalLM.from_pretrained({model!r}, attn_implementation="sdpa", tp_plan="auto").eval()
engine = TransformersCBEngine(build_manager(model, num_blocks=32, block_size=16, prefix_sharing=False))
first_turn(engine)
_, expected = second_turn(engine)
engine.forget("chat")
first_turn(engine)
table = engine.block_table("chat")
swap_out_and_in(engine, torch.float32)
new = engine.block_table("chat")
reused, got = second_turn(engine)
report = dict(kv_heads=engine.layout.kv_heads, table=table, new=new, reused=reused,
              exact=got == expected, tokens=got[0])
with open(os.path.join({out!r}, "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(report, f)
"""


@pytest.mark.skipif(os.environ.get("ZKV_TP_TEST") != "1", reason="two torch processes: 20-70 s here; set ZKV_TP_TEST=1")
def test_tensor_parallel_ranks_swap_their_shards_under_the_same_block_ids(tmp_path):
    """transformers' TP runs on CPU (gloo): each of 2 rank processes holds half the KV heads under the same ids."""
    import json
    import socket
    import subprocess
    import sys

    pytest.importorskip("accelerate")  # tp_plan="auto" needs it
    llama(0).save_pretrained(tmp_path / "model")
    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "worker.py"
    script.write_text(
        TP_WORKER.format(root=os.path.dirname(here), tests=here, model=str(tmp_path / "model"), out=str(tmp_path))
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        str(script),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["kv_heads"] for r in ranks] == [2, 2]  # 4 KV heads split over 2 ranks
    assert ranks[0]["table"] == ranks[1]["table"] and ranks[0]["new"] == ranks[1]["new"]
    assert not set(ranks[0]["table"]) & set(ranks[0]["new"])
    assert all(r["reused"] and r["exact"] for r in ranks)
    assert ranks[0]["tokens"] == ranks[1]["tokens"]


def test_take_blocks_refuses_cleanly_when_freed_blocks_and_sectors_fall_short():
    """Freed blocks sit in the pool as leaves; asking for more than leaves + free sectors turns whole free trees into
    sectors, which must be counted again: a NoFreeBlocks, not a ValueError from inside transformers' pool."""
    engine = engine_for(llama(0), num_blocks=16, prefix_sharing=False)
    engine.submit("once", tokens(3, PROMPT), max_new_tokens=4, keep=False)
    run(engine, "once")
    free = engine.free_block_count()
    with pytest.raises(NoFreeBlocks):
        engine.take_blocks(free + 1)
    blocks = engine.take_blocks(free)
    assert len(set(blocks)) == free and engine.free_block_count() == 0
    engine.return_blocks(blocks)
    assert engine.free_block_count() == free
