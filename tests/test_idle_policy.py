"""The idle-conversation policy (sans-IO): which parked conversations go to CPU."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zkv.engines.idle_policy import IdlePolicy


def test_idle_conversations_go_whatever_the_pool_holds_and_lru_ones_only_under_the_watermark():
    policy = IdlePolicy(min_free=4, idle_after=3)
    for tick, conv in enumerate("abcd"):
        policy.parked(conv, tick)
    blocks = dict.fromkeys("abcd", 2)
    assert policy.victims(3, free_blocks=10, blocks_of=blocks) == ["a"]  # idle for 3 ticks
    assert policy.victims(3, free_blocks=0, blocks_of=blocks) == ["a", "b"]  # then LRU until 4 are free
    policy.parked("a", 4)  # a took a turn: now the most recent
    assert policy.victims(4, free_blocks=0, blocks_of=blocks) == ["b", "c"]
    policy.gone("b")
    assert policy.resident == ["c", "d", "a"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        IdlePolicy(min_free=-1)
    with pytest.raises(ValueError):
        IdlePolicy(idle_after=True)


@given(
    st.lists(st.integers(1, 8), min_size=0, max_size=12),
    st.integers(0, 40),
    st.integers(0, 30),
    st.one_of(st.none(), st.integers(0, 12)),
)
def test_victims_are_oldest_first_and_restore_the_watermark_when_they_can(sizes, free, min_free, idle_after):
    policy = IdlePolicy(min_free=min_free, idle_after=idle_after)
    names = [f"c{i}" for i in range(len(sizes))]
    for tick, name in enumerate(names):
        policy.parked(name, tick)
    now = len(names)
    blocks = dict(zip(names, sizes))
    victims = policy.victims(now, free, blocks)
    assert len(set(victims)) == len(victims) and set(victims) <= set(names)
    idle = [n for t, n in enumerate(names) if idle_after is not None and now - t >= idle_after]
    assert set(idle) <= set(victims)
    assert victims == sorted(victims, key=names.index)  # LRU order: the oldest go first
    freed = free + sum(blocks[v] for v in victims)
    if free + sum(sizes) >= min_free:
        assert freed >= min_free  # the watermark holds again when enough is parked
    # and no more than needed beyond the idle ones: dropping the last LRU pick would leave it short
    extra = [v for v in victims if v not in idle]
    if extra:
        assert freed - blocks[extra[-1]] < min_free
