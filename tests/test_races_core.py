"""Pause / clear / resume: every race of docs/architecture.md's rules, as exact interleavings
of the sans-IO broker and rank cores (the end-to-end versions run real
processes in test_races_e2e.py)."""

import collections
import random

import pytest

from zkv.testing.sim import Sim
from zkv.wire import protocol as P
from zkv.wire.messages import Result


def pause_done(sim, req):
    r = sim.reply(req)
    return r is not None and r.kind == "reply"


def test_1_pause_acks_only_after_every_inflight_task_finished_and_no_copy_after():
    sim = Sim().up()
    tasks = [sim.submit() for _ in range(4)]
    for r in (0, 1):
        sim.deliver_dealer(r)
    req = sim.request("pause")
    for r in (0, 1):
        sim.deliver_pub(r)
    sim.deliver_broker()
    assert not pause_done(sim, req)
    for step in range(3):  # finish 3 of 4 on both ranks: still no ack
        for r in (0, 1):
            sim.finish(r, 1)
        sim.deliver_broker()
        assert not pause_done(sim, req), f"acked with {4 - step - 1} tasks still running"
    sim.finish(0, 1)
    sim.deliver_broker()
    assert not pause_done(sim, req), "rank 1 still has one running"
    sim.finish(1, 1)
    sim.deliver_broker()
    reply = sim.reply(req)
    assert reply.kind == "reply" and reply.extra["state"] == "paused"
    assert all(sim.outcomes[t] == "ok" for t in tasks)
    assert all(sr.copies_after_ack == 0 and sr.acked_pause for sr in sim.ranks.values())


def test_2_pub_pause_overtaking_dealer_tasks_still_runs_them_before_acking():
    sim = Sim().up()
    tasks = [sim.submit() for _ in range(3)]
    req = sim.request("pause")
    for r in (0, 1):  # the PUB pause arrives before any task
        sim.deliver_pub(r)
    sim.deliver_broker()
    assert not pause_done(sim, req)
    assert all(not sr.acked_pause for sr in sim.ranks.values())
    for r in (0, 1):
        sim.deliver_dealer(r)  # now the tasks arrive: they were dispatched before the pause
        assert all(not ex.refuse for ex in sim.ranks[r].running)
        sim.finish(r)
    sim.deliver_broker()
    assert pause_done(sim, req)
    assert [sim.outcomes[t] for t in tasks] == ["ok"] * 3


def test_3_tasks_submitted_while_pausing_and_paused_are_held_then_run_once_after_resume():
    sim = Sim().up()
    first = sim.submit()
    req = sim.request("pause")
    while_pausing = sim.submit()
    sim.settle()
    assert pause_done(sim, req)
    while_paused = sim.submit()
    sim.settle()
    assert first in sim.outcomes and while_pausing not in sim.outcomes and while_paused not in sim.outcomes
    assert sim.broker.status(sim.now)["queued"] == 2
    assert all(not sr.running for sr in sim.ranks.values())
    sim.request("resume")
    sim.settle()
    assert sim.outcomes[while_pausing] == "ok" and sim.outcomes[while_paused] == "ok"
    assert sum(1 for r in sim.results if r.task == while_paused) == 2  # once per rank, not twice


def test_4_clear_cancels_every_held_task_at_its_client():
    sim = Sim().up()
    req = sim.request("pause")
    held = [sim.submit() for _ in range(5)]
    sim.settle()
    assert pause_done(sim, req)
    creq = sim.request("clear")
    sim.settle()
    reply = sim.reply(creq)
    assert reply.kind == "reply" and reply.extra["cancelled"] == 5
    assert reply.extra["gen"] == 1 and reply.extra["freed"] > 0
    assert [sim.outcomes[t] for t in held] == ["cancelled"] * 5
    assert sim.results == []  # nothing ran
    late = sim.submit()
    assert sim.outcomes[late] == "rejected"
    assert "cleared" in [m for m in sim.client_in if getattr(m, "task", None) == late][0].reason


def test_5_stale_ack_from_an_earlier_epoch_does_not_complete_the_current_pause():
    sim = Sim().up()
    r1 = sim.request("pause")
    sim.settle()
    assert pause_done(sim, r1)
    sim.request("resume")
    sim.settle()
    sim.submit()
    for r in (0, 1):
        sim.deliver_dealer(r)  # a task is running on both ranks
    r2 = sim.request("pause")
    epoch = sim.broker.epoch
    stale = P.encode("ack", epoch=epoch - 2, op="pause", upto=0, gen=0)
    for r in (0, 1):
        sim.broker.on_rank(f"rank-{r}".encode(), [stale], sim.now)
    wrong_upto = P.encode("ack", epoch=epoch, op="pause", upto=0, gen=0)
    for r in (0, 1):
        sim.broker.on_rank(f"rank-{r}".encode(), [wrong_upto], sim.now)
    assert not pause_done(sim, r2)
    assert sim.broker.counters["stale_acks"] == 4
    sim.settle()
    assert pause_done(sim, r2)


def test_6_result_from_previous_generation_is_ignored_by_the_client():
    sim = Sim().up()
    t = sim.submit()
    for r in (0, 1):
        sim.deliver_dealer(r)
    sim.finish(0)
    # rank 1's result is "in flight" while the bus is paused, cleared, resumed
    sim.ranks[1].running.clear()
    sim.book.gen = 1  # the client learned gen 1 from the clear reply
    sim.book.cancel_all("cleared", sim.now)
    stale = Result(task=t, rank=1, world=2, outcome="ok", reason="", gen=0)
    t2 = sim.submit()
    assert sim.book.on_result(stale, sim.now) is None
    stale_for_new = Result(task=t2, rank=1, world=2, outcome="ok", reason="", gen=0)
    assert sim.book.on_result(stale_for_new, sim.now) is None
    assert sim.book.counters["late_results"] == 1 and sim.book.counters["stale_results"] == 1
    assert t2 in sim.book.open


def test_7_rank_joining_while_paused_learns_it_and_takes_no_tasks():
    sim = Sim(world=2)
    sim.start_rank(0)
    sim.settle()
    req = sim.request("pause")
    sim.settle()
    assert pause_done(sim, req)
    sim.submit()
    sim.start_rank(1)  # joins late: the PUB pause was before its time
    sim.settle()
    assert sim.ranks[1].core.op == "pause" and sim.ranks[1].acked_pause
    assert sim.results == [] and all(not sr.running for sr in sim.ranks.values())
    assert sim.broker.ranks[1].acked_epoch == sim.broker.epoch


def test_8_lost_pub_message_is_healed_by_the_repeat():
    sim = Sim(control_repeat_ms=50).up()
    req = sim.request("pause")
    assert sim.deliver_pub(1, drop=True) == 1  # rank 1 never sees it
    sim.settle()
    assert not pause_done(sim, req)
    sim.tick(0.06)  # the repeat
    sim.settle()
    assert pause_done(sim, req)
    assert sim.broker.counters["control_repeats"] >= 1


def test_8b_a_repeat_of_an_acknowledged_state_is_acknowledged_again():
    sim = Sim(control_repeat_ms=50).up()
    req = sim.request("pause")
    sim.deliver_pub(0)
    sim.deliver_pub(1)
    sim.to_broker.clear()  # both acks lost on the way
    sim.tick(0.06)
    sim.settle()
    assert pause_done(sim, req)


def test_9a_rank_that_never_acks_fails_the_pause_naming_it_within_the_timeout():
    sim = Sim(heartbeat_ms=10_000, liveness_ms=60_000).up()
    sim.submit()
    for r in (0, 1):
        sim.deliver_dealer(r)
    req = sim.request("pause", timeout_ms=500)
    sim.deliver_pub(0)
    sim.deliver_pub(1)
    sim.finish(0)
    sim.deliver_broker()
    sim.tick(0.4)
    assert sim.reply(req) is None
    sim.tick(0.2)
    err = sim.reply(req)
    assert err.kind == "error" and err.code == "pause_timeout" and "[1]" in err.reason
    assert sim.broker.state == "running"  # undone with a new epoch, nothing waits forever
    assert sim.published[-1].op == "resume"


def test_9b_rank_killed_during_the_pause_fails_it_naming_the_rank_and_its_tasks():
    sim = Sim(heartbeat_ms=100, liveness_ms=300).up()
    t = sim.submit()
    for r in (0, 1):
        sim.deliver_dealer(r)
    req = sim.request("pause")
    sim.deliver_pub(0)
    sim.finish(0)
    sim.deliver_broker()
    for _ in range(4):  # rank 0 lives on, rank 1 is dead
        sim.now += 0.1
        sim._rank_actions(0, sim.ranks[0].core.on_tick(sim.now))
        sim.deliver_broker()
        sim.tick(0.0)
    err = sim.reply(req)
    assert err.kind == "error" and err.code == "rank_dead" and "rank 1" in err.reason
    assert sim.outcomes[t] == "failed"


def test_9c_allow_partial_completes_the_pause_without_the_dead_rank():
    sim = Sim(heartbeat_ms=100, liveness_ms=300, allow_partial=True).up()
    req = sim.request("pause")
    sim.deliver_pub(0)
    sim.deliver_broker()
    for _ in range(4):
        sim.now += 0.1
        sim._rank_actions(0, sim.ranks[0].core.on_tick(sim.now))
        sim.deliver_broker()
        sim.tick(0.0)
    assert sim.reply(req).kind == "reply"


def test_noops_and_wrong_order_say_so():
    sim = Sim().up()
    r = sim.request("resume")
    assert sim.reply(r).extra["noop"] is True
    r = sim.request("clear")
    assert sim.reply(r).code == "not_paused"
    sim.request("pause")
    r = sim.request("clear")
    assert sim.reply(r).code == "busy"
    sim.settle()
    r = sim.request("pause")
    assert sim.reply(r).extra["noop"] is True
    r = sim.request("resume", layout={"gpu_blocks": 8})
    assert sim.reply(r).code == "not_cleared"


def test_resume_naming_another_layout_on_a_running_bus_is_not_cleared_and_its_own_layout_a_noop():
    sim = Sim().up()
    held = sim.broker.layout
    r = sim.request("resume", layout={"gpu_blocks": held.gpu_blocks + 8})
    refused = sim.reply(r)
    assert refused.code == "not_cleared" and "the bus is running" in refused.reason
    assert sim.broker.layout == held and sim.broker.state == "running"
    r = sim.request("resume", layout={"gpu_blocks": held.gpu_blocks})  # the bus's own layout: changes nothing
    assert sim.reply(r).extra["noop"] is True
    sim.request("pause")
    sim.settle()
    r = sim.request("resume", layout=held.to_wire())  # on a paused bus too: a plain resume
    sim.settle()
    assert sim.reply(r).kind == "reply" and sim.broker.state == "running"


def test_resume_with_a_new_layout_after_clear_reallocates():
    sim = Sim().up()
    sim.pause_and_clear()
    r = sim.request("resume", layout={"gpu_blocks": 8})
    sim.settle()
    assert sim.reply(r).kind == "reply"
    assert sim.broker.layout.gpu_blocks == 8
    assert all(sr.core.layout.gpu_blocks == 8 and sr.core.cache.phase.serves for sr in sim.ranks.values())
    t = sim.submit()
    sim.settle()
    assert sim.outcomes[t] == "ok"


def _random_request(sim: Sim, rng: random.Random, submitted: list) -> None:
    """A submit, a control request, or nothing, at random."""
    action = rng.random()
    if action < 0.45:
        submitted.append(sim.submit())
    elif action < 0.6:
        sim.request("pause")
    elif action < 0.7:
        sim.request("clear")
    elif action < 0.85:
        sim.request("resume")


def _random_delivery(sim: Sim, rng: random.Random) -> None:
    """Deliver a random part of what is in flight to one rank or the broker,
    PUB messages possibly lost."""
    r = rng.randrange(2)
    step = rng.random()
    if step < 0.3:
        sim.deliver_dealer(r, rng.randint(1, 3))
    elif step < 0.5:
        sim.deliver_pub(r, drop=rng.random() < 0.2)
    elif step < 0.8:
        sim.finish(r, rng.randint(1, 3))
    else:
        sim.deliver_broker(rng.randint(1, 4))
    sim.finish_cache_ops(r)


@pytest.mark.parametrize("seed", range(4))
def test_10_random_cycles_every_task_one_outcome_no_copy_while_paused(seed):
    """Random pause/clear/resume cycles (250 per seed, 1,000 in all) with random
    delivery order, lost PUB messages and interleaved submissions."""
    rng = random.Random(seed)
    sim = Sim(control_repeat_ms=10).up()
    submitted = []
    steps = 0
    while sim.broker.counters["pause_ok"] < 250:
        steps += 1
        assert steps < 20_000, "cycles stopped completing"
        _random_request(sim, rng, submitted)
        for _ in range(rng.randint(0, 6)):
            _random_delivery(sim, rng)
        if rng.random() < 0.2:
            sim.tick(0.011)
        if rng.random() < 0.3:
            sim.settle()
    # drain: resume whatever state we are in, heal lost messages, finish all
    for _ in range(20):
        sim.tick(0.011)
        sim.settle()
        if sim.broker.pending is None:
            break
    sim.request("resume")
    for _ in range(20):
        sim.tick(0.011)
        sim.settle()
    missing = [t for t in submitted if t not in sim.outcomes]
    assert not missing, f"tasks without an outcome: {missing[:10]}"
    assert set(sim.outcomes) == set(submitted)
    assert all(sr.copies_after_ack == 0 for sr in sim.ranks.values())
    assert sim.broker.state == "running" and not sim.broker.inflight and not sim.broker.queue
    outcomes = set(sim.outcomes.values())
    assert {"ok", "cancelled", "rejected"} <= outcomes, outcomes
    assert sim.broker.counters["clear_ok"] > 10 and sim.broker.counters["resume_ok"] >= 250
    # the metrics book agrees with the core: every task booked once, under the outcome it ended with
    booked = collections.Counter()
    for (_, outcome), series in sim.broker.book.tasks.items():
        booked[outcome] += series.rtt.count
    assert booked == collections.Counter(sim.outcomes.values()) and sum(booked.values()) == len(submitted)
    for op in ("pause", "clear", "resume"):
        assert sim.broker.book.controls[(op, "ok")] == sim.broker.counters[f"{op}_ok"]
        assert sim.broker.book.control_seconds[(op,)].count == sim.broker.counters[f"{op}_ok"]


def test_a_timed_out_task_settles_when_its_late_rank_reports():
    sim = Sim().up()
    t = sim.submit()
    for r in (0, 1):
        sim.deliver_dealer(r)
    sim.finish(0)
    (out,) = sim.book.expire(sim.now + 31)
    assert out.outcome == "timeout" and "[1]" in out.reason
    assert sim.book.take_settled() == []
    sim.finish(1)  # the slow rank finally copies
    assert t not in sim.outcomes, "the late result is not a second outcome"
    assert sim.book.take_settled() == [t]


def test_broker_cancelled_task_settles_after_the_client_timed_out():
    sim = Sim().up()
    sim.request("pause")
    sim.settle()
    t = sim.submit()  # held
    (out,) = sim.book.expire(sim.now + 31)
    assert out.outcome == "timeout"
    sim.request("clear")  # the broker cancels it: it never reached a rank
    sim.settle()
    assert sim.book.take_settled() == [t]


def test_a_restarted_broker_takes_the_ranks_generation_and_they_get_caches_back():
    sim = Sim().up()
    sim.pause_and_clear()
    assert sim.broker.gen == 1 and not any(sr.core.cache.phase.serves for sr in sim.ranks.values())
    # the broker dies and a fresh one starts: the ranks re-register with it
    from zkv.broker.core import BrokerConfig, BrokerCore

    sim.broker = BrokerCore(BrokerConfig(world=2))
    for r in sim.ranks:
        sim.start_rank(r)
    sim.settle()
    # A broker with no state file cannot know the bus was cleared: it takes the
    # ranks' generation (1), and because their memory is gone it moves the bus
    # to a new one, which it publishes to every rank.
    assert sim.broker.gen == 2 and sim.broker.state == "running"
    assert all(sr.core.cache.phase.serves and sr.core.gen == 2 for sr in sim.ranks.values())
    sim.book.gen = 2  # a client that learned it
    t = sim.submit()
    sim.settle()
    assert sim.outcomes[t] == "ok"


def test_tasks_dispatched_after_a_failed_pause_overtake_the_resume_and_are_held_not_failed():
    sim = Sim(heartbeat_ms=10_000, liveness_ms=60_000).up()
    req = sim.request("pause", timeout_ms=100)
    sim.deliver_pub(0)  # rank 0 acks; rank 1 never sees the pause
    sim.ranks[1].sub_in.clear()
    sim.deliver_broker()
    sim.tick(0.2)  # the pause fails: the broker runs again (new epoch, "resume")
    assert sim.reply(req).code == "pause_timeout" and sim.broker.state == "running"
    t = sim.submit()
    sim.deliver_dealer(0)  # the task overtakes the resume on rank 0
    assert not sim.ranks[0].running and sim.ranks[0].core.held
    sim.settle()
    assert sim.outcomes[t] == "ok"
    assert all(sr.copies_after_ack == 0 for sr in sim.ranks.values())


def cache_op_done(sim, rank, error=""):
    """The simulated executor reports rank's oldest queued free or allocation
    (``error``: it raised)."""
    sr = sim.ranks[rank]
    sr.cache_ops.popleft()
    sim._rank_actions(rank, sr.core.on_cache_done(0, error))


def failed_resume_on_rank_0(sim, **fields):
    """Both ranks queue the resume's allocation; rank 0's fails and its ack
    reaches the broker, whose rollback (a clear) both ranks then receive."""
    req = sim.request("resume", layout={"gpu_blocks": 8}, **fields)
    for r in (0, 1):
        sim.deliver_pub(r)
    cache_op_done(sim, 0, "RuntimeError: out of memory")
    sim.deliver_broker()
    assert sim.broker.state == "cleared" and sim.published[-1].op == "clear"
    for r in (0, 1):  # rank 0 acks at once; rank 1 queues a free behind its allocation
        sim.deliver_pub(r)
    sim.deliver_broker()
    return req


def test_a_failed_resume_is_answered_only_once_every_rank_rolled_back():
    sim = Sim().up()
    sim.pause_and_clear()
    req = failed_resume_on_rank_0(sim)
    assert sim.reply(req) is None, "answered while rank 1's allocation was still queued"
    cache_op_done(sim, 1)  # its allocation for the failed epoch, done: that acks no rollback
    sim.deliver_broker()
    assert sim.reply(req) is None, "rank 1 acked the rollback before its free ran"
    cache_op_done(sim, 1)  # the rollback's free
    sim.deliver_broker()
    err = sim.reply(req)
    assert err.kind == "error" and err.code == "alloc_failed" and "rank 0" in err.reason
    assert err.reason.endswith("the bus is cleared again")
    assert sim.broker.pending is None and not any(sr.core.cache.phase.serves for sr in sim.ranks.values())
    again = sim.request("resume")
    sim.settle()
    assert sim.reply(again).kind == "reply" and sim.broker.state == "running"


def test_a_failed_resume_is_answered_by_its_deadline_and_a_late_allocation_answers_no_later_resume():
    sim = Sim().up()
    sim.pause_and_clear()
    req = failed_resume_on_rank_0(sim, timeout_ms=500)
    busy = sim.request("pause")  # nothing starts while the ranks roll back
    assert sim.reply(busy).code == "busy" and "rolling back" in sim.reply(busy).reason
    sim.tick(0.6)  # the resume's deadline: answered, naming the rank that had not rolled back
    err = sim.reply(req)
    assert err.code == "alloc_failed" and "ranks [1] had not confirmed" in err.reason
    again = sim.request("resume")
    for r in (0, 1):
        sim.deliver_pub(r)
    cache_op_done(sim, 0)
    cache_op_done(sim, 1, "RuntimeError: out of memory")  # the failed epoch's allocation, reported late
    sim.deliver_broker()
    assert sim.reply(again) is None, "an earlier epoch's allocation failed this resume"
    cache_op_done(sim, 1)  # the rollback's free
    sim.deliver_broker()
    assert sim.reply(again) is None, "a free's report acked a resume whose allocation had not run"
    cache_op_done(sim, 1)  # this resume's own allocation
    sim.deliver_broker()
    assert sim.reply(again).kind == "reply" and sim.broker.state == "running"
    assert all(sr.core.cache.phase.serves for sr in sim.ranks.values())


def test_a_rank_that_dies_while_rolling_back_does_not_hold_the_failed_resume():
    sim = Sim(heartbeat_ms=100, liveness_ms=300).up()
    sim.pause_and_clear()
    req = failed_resume_on_rank_0(sim)
    for _ in range(4):  # rank 0 lives on, rank 1 (its free still queued) is dead
        sim.now += 0.1
        sim._rank_actions(0, sim.ranks[0].core.on_tick(sim.now))
        sim.deliver_broker()
        sim.tick(0.0)
    err = sim.reply(req)
    assert err.code == "alloc_failed" and err.reason.endswith("the bus is cleared again")
    assert sim.broker.pending is None and not sim.broker.ranks[1].alive


def test_a_resume_asking_for_another_layout_joins_no_resume_in_progress():
    sim = Sim().up()
    sim.pause_and_clear()
    first = sim.request("resume", layout={"gpu_blocks": 64})
    other = sim.request("resume", layout={"gpu_blocks": 32})
    bad = sim.request("resume", layout={"gpu_blocks": 0})
    same = sim.request("resume", layout={"gpu_blocks": 64})
    plain = sim.request("resume")
    err = sim.reply(other)
    assert err.code == "busy" and "'gpu_blocks': 64" in err.reason and "'gpu_blocks': 32" in err.reason
    assert sim.reply(bad).code == "bad_field"
    assert sim.reply(same) is None and sim.reply(plain) is None  # they join
    sim.settle()
    for req in (first, same, plain):
        reply = sim.reply(req)
        assert reply.kind == "reply" and reply.extra["layout"]["gpu_blocks"] == 64
    assert sim.broker.layout.gpu_blocks == 64 and all(sr.core.layout.gpu_blocks == 64 for sr in sim.ranks.values())


def test_a_clear_asking_for_another_keep_cpu_joins_no_clear_in_progress():
    sim = Sim().up()
    sim.request("pause")
    sim.settle()
    first = sim.request("clear", keep_cpu=True)
    other = sim.request("clear")
    same = sim.request("clear", keep_cpu=True)
    err = sim.reply(other)
    assert err.code == "busy" and "keep_cpu=True" in err.reason
    sim.settle()
    assert sim.reply(first).kind == sim.reply(same).kind == "reply"


def test_a_resume_that_timed_out_is_answered_at_its_deadline_not_after_the_rollback():
    sim = Sim(heartbeat_ms=10_000, liveness_ms=60_000).up()
    sim.pause_and_clear()
    req = sim.request("resume", timeout_ms=500)
    sim.deliver_pub(0)  # rank 1 never hears of it
    sim.finish_cache_ops(0)
    sim.deliver_broker()
    sim.tick(0.6)
    err = sim.reply(req)
    assert err.code == "resume_timeout" and "[1]" in err.reason and err.reason.endswith("the bus is cleared again")
    assert sim.broker.state == "cleared" and sim.broker.pending is None
    sim.settle()  # the rollback still reaches every rank
    assert not any(sr.core.cache.phase.serves for sr in sim.ranks.values())
