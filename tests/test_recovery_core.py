"""Recovery on the sans-IO cores (one layout and one generation whatever
restarts, lost memory never silent, every request answered; docs/architecture.md),
one exact interleaving each (test_bus_model.py explores the rest;
test_recovery_e2e.py runs real processes)."""

import pytest

from zkv.broker.core import BrokerConfig, BrokerCore, SaveState, ToClient, ToRank
from zkv.broker.generation import Generation
from zkv.prefix import PrefixCacheManager
from zkv.testing.fakebus import FakeBus
from zkv.testing.sim import LAYOUT, Sim
from zkv.wire import protocol as P


def replies(actions):
    return [P.decode(a.frames[0]) for a in actions if isinstance(a, ToClient)]


def rank_msgs(actions):
    return [P.decode(a.frames[0]) for a in actions if isinstance(a, ToRank)]


def test_pause_then_clear_with_no_rank_registered_both_answer():
    core = BrokerCore(BrokerConfig(world=2))
    (pause,) = replies(core.on_client(b"c", [P.encode("pause", req=1)], 1.0))
    (clear,) = replies(core.on_client(b"c", [P.encode("clear", req=2)], 1.0))
    assert pause.kind == clear.kind == "reply" and clear.extra["state"] == "cleared" and clear.extra["cancelled"] == 0
    assert not core.counters.get("internal_errors")


def test_an_exception_in_a_handler_answers_internal_and_is_counted():
    core = BrokerCore(BrokerConfig(world=2))
    core.control.pause = None  # type: ignore[assignment,method-assign]  # a bug: calling it raises TypeError
    (err,) = replies(core.on_client(b"c", [P.encode("pause", req=7)], 1.0))
    assert err.kind == "error" and err.code == "internal" and err.req == 7
    assert core.counters["internal_errors"] == 1
    (ping,) = replies(core.on_client(b"c", [P.encode("ping", req=8)], 1.0))
    assert ping.kind == "reply", "the broker keeps serving"


def test_every_control_change_is_saved_and_a_restored_broker_keeps_paused_and_its_layout():
    sim = Sim().up()
    saved = []
    real = sim._broker_actions
    sim._broker_actions = lambda acts: (saved.extend(a.snapshot for a in acts if isinstance(a, SaveState)), real(acts))
    sim.request("pause")
    sim.settle()
    assert saved[-1]["state"] == "paused" and saved[-1]["layout"] == LAYOUT.to_wire()
    core = BrokerCore(BrokerConfig(world=2), restore=saved[-1])
    assert core.state == "paused" and core.control.op == "pause" and core.epoch == saved[-1]["epoch"] + 1


def test_a_fresh_rank_after_tasks_ran_moves_the_generation_and_cancels_what_was_queued():
    sim = Sim().up()
    first = sim.submit()
    sim.settle()
    assert sim.outcomes[first] == "ok"
    sim.request("pause")
    sim.settle()
    queued = sim.submit()
    sim.ranks[1].core = type(sim.ranks[1].core)(1, 2, LAYOUT, sessions=sim.sessions.__next__)  # a new process
    sim.start_rank(1)
    sim.settle()
    assert sim.broker.gen == 1 and "fresh memory" in sim.broker.gens.reason
    assert sim.outcomes[queued] == "cancelled"
    assert all(sr.core.gen == 1 for sr in sim.ranks.values())
    assert sim.broker.state == "paused", "paused stays paused"


def test_the_prefix_manager_resets_when_the_bus_generation_moves_without_its_clear():
    bus = FakeBus()
    bus.gen = 0
    manager = PrefixCacheManager(bus, 4, 8, 8)
    tokens = list(range(8))
    lease = manager.allocate(2)
    manager.insert(tokens, lease.block_ids)
    manager.release(lease)
    assert manager.match(tokens).num_blocks == 2
    bus.gen = 1  # e.g. a rank came back with fresh memory
    assert manager.match(tokens).num_blocks == 0
    assert manager._counters["generation_resets"] == 1


class _MovingBus(FakeBus):
    """A bus whose cache generation moves while the next task runs."""

    move = False

    def wait(self, task: int, timeout: float | None = None):
        if self.move:
            self.gen += 1  # the task ran at the new generation and ends ok there
        return super().wait(task, timeout)


def test_the_prefix_manager_drops_a_swap_that_ran_after_a_generation_move_it_had_not_heard_of():
    bus = _MovingBus()
    bus.gen = 0
    manager = PrefixCacheManager(bus, 4, 8, 8)
    tokens = list(range(8))
    lease = manager.allocate(2)
    manager.insert(tokens, lease.block_ids)
    manager.release(lease)
    assert manager.evict(2) == 2  # swapped out to the CPU tier
    bus.move = True
    assert manager.match(tokens).num_blocks == 0, "the swap-in read memory of another generation"
    assert manager.stats()["swaps"]["swap_in"]["cancelled"] == 1


def test_every_generation_move_says_why_a_clear_and_a_failed_resume_rolled_back_to_cleared():
    sim = Sim().up()
    sim.pause_and_clear()
    st = sim.broker.status(sim.now)
    assert st["gen"] == 1 and st["gen_reason"] == "clear epoch 2 freed the caches"
    req = sim.request("resume", layout={"gpu_blocks": 8})
    for r in (0, 1):
        sim.deliver_pub(r)
        sim.ranks[r].cache_ops.popleft()
        sim._rank_actions(r, sim.ranks[r].core.on_cache_done(0, "RuntimeError: out of memory"))
    sim.settle()
    assert sim.reply(req).code == "alloc_failed"
    st = sim.broker.status(sim.now)
    assert st["gen"] == 2 and st["gen_reason"].startswith("resume epoch 3 failed (alloc_failed)"), st["gen_reason"]
    again = sim.request("resume")
    sim.settle()
    assert sim.reply(again).extra["gen_reason"] == st["gen_reason"]  # the resume reply says why too


def test_a_broker_that_lost_its_state_says_why_it_took_a_ranks_generation():
    sim = Sim().up()
    sim.pause_and_clear()
    sim.request("resume")
    sim.settle()
    assert sim.broker.gen == 1
    sim.broker = BrokerCore(BrokerConfig(world=2))  # restarted without its state file
    for r in sim.ranks:
        sim.start_rank(r)
    sim.settle()
    st = sim.broker.status(sim.now)
    assert st["gen"] == 1 and st["state"] == "running"  # the ranks' memory is intact: taken as is
    assert "no state of this bus" in st["gen_reason"] and "generation 1 from rank 0" in st["gen_reason"]


def test_a_generation_move_without_a_reason_is_refused():
    gens = Generation()
    with pytest.raises(ValueError, match="names no reason"):
        gens.move(1, "")
    with pytest.raises(ValueError):
        gens.cleared(False, "")
    assert gens.gen == 0 and gens.reason == ""


def test_a_new_process_with_another_layout_is_refused_naming_both_unless_it_adopts_the_bus_layout():
    core = BrokerCore(BrokerConfig(world=2))
    ready = {"world": 2, "gen": 0, "fresh": True}
    core.on_rank(b"r0", [P.encode("ready", rank=0, session=1, layout=LAYOUT.to_wire(), **ready)], 1.0)
    other = LAYOUT.with_changes(gpu_blocks=LAYOUT.gpu_blocks * 2, layers=LAYOUT.layers + 1)
    out = core.on_rank(b"r1", [P.encode("ready", rank=1, session=2, layout=other.to_wire(), **ready)], 1.0)
    (refused,) = rank_msgs(out)
    assert refused.kind == "refused", refused
    assert f"gpu_blocks {other.gpu_blocks} (the bus: {LAYOUT.gpu_blocks})" in refused.reason
    assert f"layers {other.layers} (the bus: {LAYOUT.layers})" in refused.reason and "--adopt-layout" in refused.reason
    assert 1 not in core.rank_table.ranks and core.gens.layout == LAYOUT, "a refused ready changes nothing"
    out = core.on_rank(
        b"r1", [P.encode("ready", rank=1, session=3, layout=other.to_wire(), adopt_layout=True, **ready)], 1.0
    )
    (welcome,) = [m for m in rank_msgs(out) if m.kind == "welcome"]
    assert welcome.layout == LAYOUT, "it adopts the bus's layout"
    not_fresh = {**ready, "fresh": False}  # a process whose memory was the bus's: the bus moved while it was away
    out = core.on_rank(b"r1", [P.encode("ready", rank=1, session=4, layout=other.to_wire(), **not_fresh)], 1.0)
    assert all(m.kind != "refused" for m in rank_msgs(out))


def test_a_ready_cpu_gen_above_2_40_is_accepted_but_never_taken_as_the_bus_cpu_generation():
    """docs/protocol.md §4.4: ``ready.cpu_gen`` is any uint on the wire; the broker takes one only up to 2^40-1."""
    for cpu_gen in (2**40, 2**53 - 1):
        core = BrokerCore(BrokerConfig(world=1))
        ready = {"rank": 0, "world": 1, "session": 1, "layout": LAYOUT.to_wire(), "gen": 5, "fresh": True}
        out = core.on_rank(b"r0", [P.encode("ready", **ready, kept_tiers=["cpu"], cpu_gen=cpu_gen)], 1.0)
        assert [m.kind for m in rank_msgs(out)] == ["welcome"]
        assert core.gens.cpu_gen < 2**40 and core.gens.gen < 2**40, (core.gens.cpu_gen, core.gens.gen)
