"""The broker's state machine with no sockets: registration, fan-out,
credits, heartbeats and liveness, status, and bad input."""

import msgpack
import pytest

from zkv.broker.core import BrokerConfig, BrokerCore, ToClient, ToRank, frames_of
from zkv.testing.sim import CLIENT, LAYOUT, Sim
from zkv.wire import protocol as P


def ready(rank: int, world: int = 2, session: int = 1, layout=LAYOUT) -> list[bytes]:
    return [P.encode("ready", rank=rank, world=world, session=session, layout=layout.to_wire(), gen=0, pid=1)]


def decoded(actions, kind=ToClient):
    return [P.decode(a.frames[0]) for a in frames_of(actions, kind)]


def test_ready_gets_welcome_with_layout_and_state():
    core = BrokerCore(BrokerConfig(world=2))
    acts = core.on_rank(b"rank-0", ready(0), 1.0)
    (welcome,) = decoded(acts, ToRank)
    assert welcome.kind == "welcome"
    assert welcome.op == "run" and welcome.epoch == 0 and welcome.upto == 0
    assert welcome.layout == LAYOUT
    assert core.status(1.0)["ranks"][0]["alive"] is True


@pytest.mark.parametrize("rank,world", [(0, 3), (2, 2)])
def test_ready_that_does_not_fit_is_refused(rank, world):
    core = BrokerCore(BrokerConfig(world=2))
    (msg,) = decoded(core.on_rank(b"x", ready(rank, world), 1.0), ToRank)
    assert msg.kind == "refused" and "world" in msg.reason
    assert core.ranks == {}


def test_submit_is_held_until_every_rank_registered_then_fanned_out():
    core = BrokerCore(BrokerConfig(world=2))
    core.on_rank(b"rank-0", ready(0), 1.0)
    body = P.encode_body("swap_out", [1, 2], [3, 4])
    acts = core.on_client(CLIENT, [P.encode("submit", task=7, reply_to="ipc:///x"), body], 1.0)
    assert frames_of(acts, ToRank) == []
    assert core.status(1.0)["queued"] == 1
    acts = core.on_rank(b"rank-1", ready(1), 1.1)
    tasks = [a for a in frames_of(acts, ToRank) if len(a.frames) == 2]
    assert sorted(a.identity for a in tasks) == [b"rank-0", b"rank-1"]
    for a in tasks:
        header = P.decode(a.frames[0])
        assert header.task == 7 and header.n == 1 and header.reply_to == "ipc:///x"
        assert a.frames[1] == body  # forwarded untouched


def test_credits_bound_inflight_per_rank_and_done_returns_them():
    sim = Sim(max_inflight_per_rank=2).up()
    for _ in range(5):
        sim.submit()
    assert [len(sim.ranks[r].dealer_in) for r in (0, 1)] == [2, 2]
    assert sim.broker.status(sim.now)["queued"] == 3
    sim.deliver_dealer(0)
    sim.deliver_dealer(1)
    sim.finish(0, 1)
    sim.deliver_broker()
    assert [len(sim.ranks[r].dealer_in) for r in (0, 1)] == [0, 0], "a credit is free only when every rank returned it"
    sim.finish(1, 1)
    sim.deliver_broker()
    assert [len(sim.ranks[r].dealer_in) for r in (0, 1)] == [1, 1]
    sim.settle()
    assert sorted(sim.outcomes.values()) == ["ok"] * 5
    assert all(rs.inflight == 0 for rs in sim.broker.ranks.values())


def test_first_failing_rank_fails_the_task():
    sim = Sim().up()
    t = sim.submit()
    sim.deliver_dealer(0)
    sim.deliver_dealer(1)
    sim.finish(0, outcome="ok")
    sim.finish(1, outcome="failed")
    assert sim.outcomes[t] == "failed"


def test_heartbeats_flow_and_a_silent_rank_is_declared_dead_failing_its_tasks():
    sim = Sim(heartbeat_ms=100, liveness_ms=300).up()
    t = sim.submit()
    sim.deliver_dealer(0)
    sim.deliver_dealer(1)
    sim.finish(0)
    sim.deliver_broker()
    sim.tick(0.15)
    assert any(len(sim.ranks[r].dealer_in) for r in (0, 1)), "broker sends heartbeats"
    # rank 0 keeps beating, rank 1 goes silent
    for _ in range(3):
        sim.now += 0.12
        sim._rank_actions(0, sim.ranks[0].core.on_tick(sim.now))
        sim.deliver_broker()
        sim.tick(0.0)
    st = sim.broker.status(sim.now)
    assert [r["alive"] for r in st["ranks"]] == [True, False]
    assert sim.outcomes[t] == "failed"
    (out,) = [m for m in sim.client_in if m.kind == "outcome"]
    assert "rank 1" in out.reason and "stopped answering" in out.reason
    assert st["counters"]["rank_deaths"] == 1


def test_dead_rank_that_comes_back_reregisters():
    sim = Sim(heartbeat_ms=100, liveness_ms=300).up()
    sim.tick(1.0)  # both silent: both dead
    assert not any(rs.alive for rs in sim.broker.ranks.values())
    sim._rank_actions(0, sim.ranks[0].core.on_tick(sim.now))  # a heartbeat from a "dead" rank
    sim.deliver_broker()
    sim.deliver_dealer(0)  # reregister -> READY
    sim.deliver_broker()
    assert sim.broker.ranks[0].alive


def test_status_reports_ranks_queue_and_counters():
    sim = Sim().up()
    sim.request("pause")
    sim.settle()
    sim.submit()
    req = sim.request("status")
    st = sim.reply(req)
    assert st.extra["state"] == "paused" and st.extra["queued"] == 1 and st.extra["world"] == 2
    assert [r["rank"] for r in st.extra["ranks"]] == [0, 1]
    assert st.extra["counters"]["submitted"] == 1


@pytest.mark.parametrize(
    "frames,code",
    [
        ([b"\xc1garbage"], "malformed"),
        ([msgpack.packb([1, 2])], "malformed"),
        ([msgpack.packb({"v": 2, "kind": "status", "req": 1})], "bad_version"),
        ([msgpack.packb({"v": 1, "kind": "launch", "req": 1})], "unknown_kind"),
        ([msgpack.packb({"v": 1, "kind": "status"})], "bad_field"),
        ([msgpack.packb({"v": 1, "kind": "status", "req": -1})], "bad_field"),
        (
            [msgpack.packb({"v": 1, "kind": "ready", "rank": 0, "world": 2, "session": 1, "layout": {}, "gen": 0})],
            "unknown_kind",
        ),
        ([P.encode("status", req=1)] * 3, "malformed"),
        ([b"\x00" * (P.MAX_FRAME_BYTES + 1)], "too_large"),
    ],
)
def test_bad_client_input_gets_an_error_reply_and_the_broker_keeps_serving(frames, code):
    core = BrokerCore(BrokerConfig(world=1))
    (msg,) = decoded(core.on_client(CLIENT, frames, 1.0))
    assert msg.kind == "error" and msg.code == code and msg.reason
    (ok,) = decoded(core.on_client(CLIENT, [P.encode("ping", req=9)], 1.0))
    assert ok.kind == "reply" and ok.req == 9
    assert core.counters["bad_requests"] == 1


def test_submit_with_duplicate_open_task_id_or_bad_reply_to_is_refused():
    sim = Sim().up()
    t = sim.submit()
    frames = [P.encode("submit", task=t, reply_to="ipc:///sim/client"), P.encode_body("swap_out", [0], [0])]
    (err,) = decoded(sim.broker.on_client(CLIENT, frames, sim.now))
    assert err.code == "duplicate_task"
    frames = [P.encode("submit", task=99, reply_to="http://evil"), P.encode_body("swap_out", [0], [0])]
    (out,) = decoded(sim.broker.on_client(CLIENT, frames, sim.now))
    assert out.kind == "outcome" and out.outcome == "rejected"
    (out,) = decoded(sim.broker.on_client(CLIENT, frames[:1], sim.now))
    assert out.outcome == "rejected" and "body" in out.reason


def test_queue_full_rejects_with_a_reason():
    sim = Sim(max_queue=2)
    for _ in range(3):
        sim.submit()
    rejected = [m for m in sim.client_in if m.kind == "outcome"]
    assert len(rejected) == 1 and "queue full" in rejected[0].reason


def test_bad_rank_message_gets_an_error_and_unregistered_rank_is_told_to_reregister():
    core = BrokerCore(BrokerConfig(world=1))
    (err,) = decoded(core.on_rank(b"rank-0", [b"junk"], 1.0), ToRank)
    assert err.kind == "error" and err.code == "malformed"
    (msg,) = decoded(core.on_rank(b"rank-0", [P.encode("hb")], 1.0), ToRank)
    assert msg.kind == "reregister"


def test_restarted_rank_takes_over_and_its_lost_tasks_fail():
    sim = Sim().up()
    t = sim.submit()
    sim.deliver_dealer(0)
    sim.deliver_dealer(1)
    sim.finish(1)
    sim.deliver_broker()
    # rank 0 restarts: a new session with the same identity
    sim.ranks[0].running.clear()
    sim.start_rank(0)
    sim.deliver_broker()
    assert sim.outcomes[t] == "failed"
    assert sim.broker.ranks[0].alive and sim.broker.ranks[0].inflight == 0
    t2 = sim.submit()
    sim.settle()
    assert sim.outcomes[t2] == "ok"


def test_publish_carries_upto_per_rank():
    sim = Sim().up()
    for _ in range(3):
        sim.submit()
    sim.request("pause")
    pub = sim.published[-1]
    assert pub.op == "pause" and pub.upto == [3, 3] and pub.epoch == 1


def test_rank_registering_during_a_resume_with_a_new_layout_gets_the_new_layout():
    sim = Sim(world=2)
    sim.start_rank(0)
    sim.settle()
    sim.pause_and_clear()
    req = sim.request("resume", layout={"gpu_blocks": 8})
    sim.deliver_pub(0)  # rank 0 reallocates; its ack is on the way
    sim.start_rank(1)  # joins mid-resume
    sim.settle()
    assert sim.reply(req).kind == "reply"
    assert all(sr.core.layout.gpu_blocks == 8 for sr in sim.ranks.values())


def test_resume_ack_with_the_old_layout_does_not_complete_a_layout_change():
    sim = Sim().up()
    sim.pause_and_clear()
    req = sim.request("resume", layout={"gpu_blocks": 8})
    wrong = P.encode("ack", epoch=sim.broker.epoch, op="resume", gen=sim.broker.gen, layout=LAYOUT.to_wire())
    for r in (0, 1):
        sim.broker.on_rank(f"rank-{r}".encode(), [wrong], sim.now)
    assert sim.reply(req) is None
    sim.settle()
    assert sim.reply(req).kind == "reply"


def test_error_replies_echo_a_readable_req_or_task():
    core = BrokerCore(BrokerConfig(world=1))
    (err,) = decoded(core.on_client(CLIENT, [msgpack.packb({"v": 7, "kind": "status", "req": 42})], 1.0))
    assert err.code == "bad_version" and err.req == 42
    (err,) = decoded(core.on_client(CLIENT, [msgpack.packb({"v": 1, "kind": "submit", "task": 5})], 1.0))
    assert err.code == "bad_field" and err.task == 5


def test_oversized_task_body_is_rejected_at_the_broker():
    sim = Sim().up()
    frames = [P.encode("submit", task=1, reply_to="ipc:///sim/c"), b"\x00" * (P.MAX_FRAME_BYTES + 1)]
    (out,) = decoded(sim.broker.on_client(CLIENT, frames, sim.now))
    assert out.outcome == "rejected" and "exceeds" in out.reason


def submit_with_timeout(sim, task: int, timeout_ms: int | None) -> None:
    sim.book.add(task, sim.now, 30.0)
    fields = {} if timeout_ms is None else {"timeout_ms": timeout_ms}
    header = P.encode("submit", task=task, reply_to="ipc:///sim/client", **fields)
    sim._broker_actions(sim.broker.on_client(CLIENT, [header, P.encode_body("swap_out", [0], [0])], sim.now))


def test_a_queued_task_past_its_submit_timeout_ends_timeout_at_its_deadline_and_never_runs():
    sim = Sim().up()
    sim.request("pause")
    sim.settle()
    t0 = sim.now
    submit_with_timeout(sim, 50, 300)
    submit_with_timeout(sim, 51, None)
    submit_with_timeout(sim, 52, 600)
    assert sim.broker.tasks.deadline() == pytest.approx(t0 + 0.3)  # the loop wakes for it (next_deadline)
    sim.tick(0.299)
    assert 50 not in sim.outcomes
    sim.tick(0.002)  # its deadline passed: ended now, while the bus stays paused
    (out,) = [m for m in sim.client_in if m.kind == "outcome" and m.task == 50]
    assert out.outcome == "timeout" and "never dispatched" in out.reason and out.ran is False
    st = sim.broker.status(sim.now)
    assert st["state"] == "paused" and st["queued"] == 2 and sim.outcomes[50] == "timeout"
    assert sim.broker.tasks.deadline() == pytest.approx(t0 + 0.6)  # task 52's next
    sim.request("resume")
    sim.settle()
    assert sim.outcomes[51] == sim.outcomes[52] == "ok"
    assert all(sr.copies == 2 for sr in sim.ranks.values()), "the expired task ran"
    assert sim.broker.counters["timeout"] == 1 and not sim.broker.queue


def _outcome_of(sim, task: int):
    (out,) = [m for m in sim.client_in if m.kind == "outcome" and m.task == task]
    return out


def test_a_cancel_ends_a_queued_task_before_its_reply_and_is_too_late_for_a_dispatched_one():
    sim = Sim().up()
    sim.request("pause")
    sim.settle()
    queued = sim.submit()
    req = sim.request("cancel", task=queued)
    out = _outcome_of(sim, queued)
    answer = sim.reply(req)
    assert sim.client_in.index(out) < sim.client_in.index(answer), "the outcome comes before the reply"
    assert out.outcome == "cancelled" and out.ran is False and "by its client" in out.reason
    assert answer.op == "cancel" and answer.extra == {"task": queued, "cancelled": True, "state": "queued"}
    assert sim.outcomes[queued] == "cancelled" and sim.broker.status(sim.now)["queued"] == 0
    again = sim.request("cancel", task=queued)  # it ended: a second cancel says so
    assert sim.reply(again).extra == {"task": queued, "cancelled": False, "state": "done"}
    stranger = sim.request("cancel", task=10**9)
    assert sim.reply(stranger).extra == {"task": 10**9, "cancelled": False, "state": "unknown"}
    sim.request("resume")
    sim.settle()
    assert all(sr.copies == 0 for sr in sim.ranks.values()), "the cancelled task ran"
    running = sim.submit()
    late = sim.request("cancel", task=running)  # dispatched at once on a running bus
    assert sim.reply(late).extra == {"task": running, "cancelled": False, "state": "dispatched"}
    sim.settle()
    assert sim.outcomes[running] == "ok" and sim.broker.counters["client_cancels"] == 1


def test_a_cancel_names_only_the_tasks_of_its_own_connection():
    sim = Sim().up()
    sim.request("pause")
    sim.settle()
    task = sim.submit()
    acts = sim.broker.on_client(b"client-other", [P.encode("cancel", req=1, task=task)], sim.now)
    (answer,) = decoded(acts)
    assert answer.extra["state"] == "unknown" and sim.broker.status(sim.now)["queued"] == 1


def test_every_outcome_of_a_task_the_broker_never_dispatched_says_ran_false():
    sim = Sim().up()
    sim.request("pause")
    sim.settle()
    queued = sim.submit()
    sim.request("clear")
    sim.settle()
    rejected = sim.submit()
    assert _outcome_of(sim, queued).ran is False and _outcome_of(sim, queued).outcome == "cancelled"
    assert _outcome_of(sim, rejected).ran is False and _outcome_of(sim, rejected).outcome == "rejected"


def test_once_every_rank_acked_the_loop_sleeps_until_a_real_deadline():
    """The control op's repeat is due only while a live rank has not acked it: an idle broker's
    poll waits for its heartbeat, not 1 ms at a time."""
    sim = Sim().up()
    req = sim.request("pause")
    repeat_s = sim.broker.cfg.control_repeat_ms / 1000
    assert sim.now + repeat_s in sim.broker.control.deadlines()  # owed until the ranks ack
    sim.settle()
    assert sim.reply(req).kind == "reply"
    assert sim.broker.control.deadlines() == []
    sim.broker.on_tick(sim.now + 2 * repeat_s)
    assert sim.broker.next_deadline(sim.now + 2 * repeat_s) > 0.3  # the next heartbeat, ~0.5 s on
    assert sim.broker.counters["control_repeats"] == 0
