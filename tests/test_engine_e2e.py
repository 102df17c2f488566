"""A transformers model on the real bus: a broker process, 2 engine replicas
each with a zkv rank attached in-process to its cache, the swap controller.
Its KV goes out to zkv's CPU tier and back through swap tasks, the RL cycle
runs through pause/clear/resume, and failed or timed-out tasks fall back to
recompute, with generation exact in every case."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch_threads import one_torch_thread  # noqa: E402, F401  (autouse: one torch thread here)

from zkv.engines.transformers.build import PINNED_VERSION, build_manager  # noqa: E402
from zkv.engines.transformers.engine import TransformersCBEngine  # noqa: E402
from zkv.harness.transformers.rig import EngineRig, hold_ids  # noqa: E402
from zkv.rank.store import block_digests  # noqa: E402
from zkv.testing.models import load_weights, random_llama, random_tokens  # noqa: E402

if transformers.__version__ != PINNED_VERSION:
    pytest.skip(f"needs transformers=={PINNED_VERSION}", allow_module_level=True)

PROMPT, TURN1, USER2, TURN2 = 40, 12, 12, 10  # 51 KV tokens after turn 1: 3 full blocks of 16 and a partial one


def rig_for(model, **kw) -> EngineRig:
    kw.setdefault("num_blocks", 32)
    kw.setdefault("cpu_rows", 32)
    return EngineRig(model, ranks=2, block_size=16, timeout=10.0, **kw)


def plain_run(engine, request_id, tokens, new_tokens):
    """A turn on an engine with no zkv: (tokens, logprobs)."""
    engine.submit(request_id, tokens, max_new_tokens=new_tokens)
    engine.run_until_idle()
    out = engine.result(request_id)
    assert out is not None and out.error is None
    return out.generated_tokens, out.logprobs


def baseline(rig: EngineRig):
    """Two turns of "chat" with no swap and no zkv: the reference."""
    engine = rig.new_engine()
    turn1 = plain_run(engine, "chat", random_tokens(1, PROMPT), TURN1)
    assert engine.continue_request("chat", random_tokens(2, USER2), max_new_tokens=TURN2)
    engine.run_until_idle()
    out = engine.result("chat")
    return turn1, (out.generated_tokens, out.logprobs)


def first_turn(rig: EngineRig):
    ctrl = rig.controller
    ctrl.submit("chat", random_tokens(1, PROMPT), TURN1)
    ctrl.run_until_idle()
    out = ctrl.result("chat")
    return out.generated_tokens, out.logprobs


def second_turn(rig: EngineRig):
    how = rig.controller.continue_turn("chat", random_tokens(2, USER2), TURN2)
    rig.controller.run_until_idle()
    out = rig.controller.result("chat")
    return how, (out.generated_tokens, out.logprobs)


def scribble(rig: EngineRig, blocks: list[int], seed: int) -> None:
    """Plausible KV values (no NaNs), not the right ones, over ``blocks`` on every replica."""
    for engine in rig.replicas:
        rows = engine.block_rows()
        dtype = engine.layout.dtype
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(len(blocks) * rows.shape[1] // dtype.itemsize, generator=g).to(dtype)
        rows[torch.tensor(blocks)] = noise.view(torch.uint8).view(len(blocks), -1)


def digests(rig: EngineRig, conversation: str) -> list[list[bytes]]:
    return [block_digests([e.block_rows()], e.block_table(conversation)) for e in rig.replicas]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_swapped_out_and_back_through_the_bus_continues_bit_for_bit(dtype):
    model = random_llama(0, dtype)
    with rig_for(model) as rig:
        turn1, expected = baseline(rig)
        assert first_turn(rig) == turn1
        old = rig.replicas[0].block_table("chat")
        before = digests(rig, "chat")
        assert rig.controller.swap_out("chat")
        assert rig.controller.stats.swap_outs == 1
        scribble(rig, old, seed=7)  # the engine reuses the released blocks for someone else
        held = hold_ids(rig.replicas, old)  # so the swap-in must land in other block ids
        how = rig.controller.continue_turn("chat", random_tokens(2, USER2), TURN2)
        assert how == "swapped_in"
        new = rig.replicas[0].block_table("chat")
        assert not set(new) & set(old) and [e.block_table("chat") for e in rig.replicas] == [new, new]
        assert digests(rig, "chat") == before  # the bytes, not only the logits (a block-order error hides there)
        for engine, blocks in zip(rig.replicas, held):
            engine.return_blocks(blocks)
        rig.controller.run_until_idle()
        out = rig.controller.result("chat")  # also checks both replicas generated the same tokens
        assert (out.generated_tokens, out.logprobs) == expected

        # Negative control: the same swap-out, but the swap-in is skipped (new ids installed, never written)
        rig.controller.forget("chat")
        assert first_turn(rig) == turn1
        old = rig.replicas[0].block_table("chat")
        assert rig.controller.swap_out("chat")
        rig.controller.drop_cpu_copy("chat")  # zkv "loses" the CPU copy: nothing will be swapped in
        new = [e.take_blocks(e.blocks_needed("chat")) for e in rig.replicas]
        scribble(rig, new[0], seed=8)
        for engine, blocks in zip(rig.replicas, new):
            engine.install_block_table("chat", blocks)
        for engine in rig.replicas:
            assert engine.continue_request("chat", random_tokens(2, USER2), max_new_tokens=TURN2)
        rig.controller.run_until_idle()
        assert rig.controller.result("chat").generated_tokens != expected[0]


def test_rl_cycle_through_the_bus_resumes_on_a_new_cache_with_new_weights():
    model = random_llama(0)
    with rig_for(model) as rig:
        turn1 = first_turn(rig)
        assert rig.controller.swap_out("chat")  # KV on zkv's CPU tier when the trainer's cycle starts
        cycle = rig.rl_cycle(lambda: load_weights(model, seed=1))
        assert cycle["storage_expired"]  # the engines freed their caches and no rank held a view of them
        assert cycle["generation"] == 1 and rig.controller.swapped == []
        ref = TransformersCBEngine(build_manager(random_llama(1), num_blocks=32, block_size=16, prefix_sharing=False))
        expected_new = plain_run(ref, "new", random_tokens(4, PROMPT), TURN1)
        expected_chat = plain_run(ref, "chat", random_tokens(1, PROMPT) + turn1[0] + random_tokens(2, USER2), TURN2)
        rig.controller.submit("new", random_tokens(4, PROMPT), TURN1)
        rig.controller.run_until_idle()
        out = rig.controller.result("new")
        assert (out.generated_tokens, out.logprobs) == expected_new
        assert second_turn(rig) == ("recomputed", expected_chat)  # KV made with the old weights is never reused
        # The ranks serve the new cache: a round trip through the bus into other ids keeps the bytes
        before = digests(rig, "new")
        old = rig.replicas[0].block_table("new")
        assert rig.controller.swap_out("new")
        held = hold_ids(rig.replicas, old)
        assert rig.controller.swap_in("new")
        assert digests(rig, "new") == before and not set(old) & set(rig.replicas[0].block_table("new"))
        for engine, blocks in zip(rig.replicas, held):
            engine.return_blocks(blocks)


def test_a_swap_in_that_times_out_recomputes_exactly_and_holds_its_blocks_only_while_a_copy_may_land():
    model = random_llama(0)
    with rig_for(model) as rig:
        turn1, expected = baseline(rig)
        assert first_turn(rig) == turn1
        assert rig.controller.swap_out("chat")
        free_before = rig.replicas[0].free_block_count()
        rig.client.pause(timeout=10)  # an operator paused the bus: the swap-in is held and its wait runs out
        rig.controller.timeout = 0.3
        how = rig.controller.continue_turn("chat", random_tokens(2, USER2), TURN2)
        assert how == "recomputed" and rig.controller.stats.failed == {"swap_in:timeout": 1}
        # Two orders race at the deadline: the client gives up first (the task may still
        # copy: its blocks stay taken until it settles), or the broker's word that it expired
        # in the queue comes first (it never ran: nothing is held).
        late = rig.controller.quarantined
        assert late in (0, 1)
        rig.controller.run_until_idle()
        got = rig.controller.result("chat")
        rig.client.resume(timeout=10)  # a held task now settles (run late, or expired in the queue)
        if late:
            assert rig.controller.reap(wait=10.0) == 1
        assert rig.controller.quarantined == 0
    ref = rig.new_engine()
    expected_recompute = plain_run(ref, "chat", random_tokens(1, PROMPT) + turn1[0] + random_tokens(2, USER2), TURN2)
    assert (got.generated_tokens, got.logprobs) == expected_recompute
    assert got.generated_tokens == expected[0]
    assert free_before > 0


def test_a_failed_swap_out_keeps_the_conversation_resident_and_exact():
    model = random_llama(0)
    # The controller believes in 32 CPU rows, the ranks have 4: a swap-out to rows 4.. fails on every rank
    with rig_for(model, rank_rows=[4, 4]) as rig:
        turn1, expected = baseline(rig)
        assert first_turn(rig) == turn1
        rig.controller.submit("filler", random_tokens(9, 40), 4)
        rig.controller.run_until_idle()
        rig.controller.result("filler")
        assert rig.controller.swap_out("filler")  # rows 0-3: fine
        assert not rig.controller.swap_out("chat")  # rows 4-7: past the ranks' tiers
        assert rig.controller.stats.failed == {"swap_out:failed": 1}
        assert (
            "out of range for the cpu tier" in rig.controller.stats.last_reason
        )  # refused by the ranks for the row range, not anything else
        assert rig.replicas[0].conversation("chat").resident
        assert second_turn(rig) == ("resident", expected)


def test_the_engine_demo_swaps_in_instead_of_recomputing_and_survives_the_cycle():
    from zkv.harness.transformers.demo import ChatPlan, run_engine_demo

    lines: list[str] = []
    assert run_engine_demo(2, ChatPlan(conversations=6, rounds=6), echo=lines.append), "\n".join(lines)
    text = "\n".join(lines)
    assert "cache storage expired: True" in text and "bit-identical on every rank" in text
    assert "failed none" in text and "swapped in instead of a prefill" in text


def test_a_swap_in_the_bus_rejects_recomputes_exactly():
    """The trainer cleared the bus's caches (the ranks dropped their views) while a conversation was on CPU."""
    model = random_llama(0)
    with rig_for(model) as rig:
        turn1 = first_turn(rig)
        assert rig.controller.swap_out("chat")
        rig.client.pause(timeout=10)
        rig.client.clear(timeout=10)
        how, got = second_turn(rig)
        assert how == "recomputed" and rig.controller.stats.failed == {"swap_in:rejected": 1}
        assert rig.controller.quarantined == 0  # a rejected task never reached a rank: its blocks went back at once
        free = rig.replicas[0].free_block_count()
        rig.controller.forget("chat")
        assert rig.replicas[0].free_block_count() > free
    ref = rig.new_engine()
    assert got == plain_run(ref, "chat", random_tokens(1, PROMPT) + turn1[0] + random_tokens(2, USER2), TURN2)
