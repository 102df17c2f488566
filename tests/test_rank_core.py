"""The rank state machine alone: what it acks, when, and what it refuses."""

import itertools

from zkv.rank.core import Acked, AllocateCache, Execute, FreeCache, RankCore, ToBroker
from zkv.testing.sim import LAYOUT
from zkv.wire import protocol as P
from zkv.wire.vocab import RankOutcome


def welcomed(op="run", epoch=0, upto=0, gen=0) -> RankCore:
    core = RankCore(0, 2, LAYOUT, sessions=itertools.count(1).__next__)
    core.start(1.0)
    core.on_broker(
        P.encode("welcome", epoch=epoch, op=op, gen=gen, upto=upto, layout=LAYOUT.to_wire(), heartbeat_ms=100), 1.0
    )
    return core


def control(op, epoch, upto=(0, 0), gen=0, **kw) -> bytes:
    return P.encode("control", epoch=epoch, op=op, gen=gen, upto=list(upto), **kw)


def task(n, gen=0) -> list[bytes]:
    return [P.encode("task", seq=n, n=n, task=n, reply_to="ipc:///sim/c", gen=gen), P.encode_body("swap_out", [0], [0])]


def sent(actions, kind):
    return [P.decode(a.frame) for a in actions if isinstance(a, ToBroker) and P.decode(a.frame).kind == kind]


def test_ack_waits_for_received_upto_and_zero_inflight():
    core = welcomed()
    assert sent(core.on_control(control("pause", 1, upto=(2, 0)), 1.0), "ack") == []
    (ex1,) = [a for a in core.on_task(*task(1), 1.0) if isinstance(a, Execute)]
    assert ex1.refuse == ""
    assert sent(core.on_finished(1, 1, RankOutcome.OK, 0, 0), "ack") == []  # task 2 not received yet
    (ex2,) = [a for a in core.on_task(*task(2), 1.0) if isinstance(a, Execute)]
    assert ex2.refuse == "", "a task dispatched before the pause runs"
    acts = core.on_finished(2, 2, RankOutcome.OK, 0, 0)
    (ack,) = sent(acts, "ack")
    assert ack.as_map() == {**ack.as_map(), "epoch": 1, "op": "pause", "upto": 2}
    assert any(isinstance(a, Acked) for a in acts)


def test_task_that_overtook_the_resume_is_held_until_it_arrives_then_run():
    core = welcomed()
    core.on_control(control("pause", 1), 1.0)  # acked: upto 0
    assert [a for a in core.on_task(*task(1), 1.0) if isinstance(a, Execute)] == [], "no copy while paused"
    assert core.counters["held_until_control"] == 1
    assert sent(core.on_control(control("pause", 1), 1.0), "ack") == [], "a held task is in flight"
    acts = core.on_control(control("resume", 2), 1.0)
    (ex,) = [a for a in acts if isinstance(a, Execute)]
    assert ex.n == 1 and ex.refuse == ""
    assert sent(acts, "ack")


def test_stale_control_is_ignored_and_repeat_is_reacked():
    core = welcomed()
    assert sent(core.on_control(control("pause", 2), 1.0), "ack")
    assert sent(core.on_control(control("pause", 2), 1.0), "ack"), "a repeat gets a fresh ack"
    assert sent(core.on_control(control("resume", 1), 1.0), "ack") == []
    assert core.counters["stale_controls"] == 1 and core.op == "pause"


def test_clear_frees_then_acks_with_bytes_and_resume_reallocates_then_acks():
    core = welcomed()
    core.on_control(control("pause", 1), 1.0)
    acts = core.on_control(control("clear", 2, gen=1, keep_cpu=True), 1.0)
    assert [a for a in acts if isinstance(a, FreeCache)] == [FreeCache(keep_cpu=True)]
    assert sent(acts, "ack") == []
    (ack,) = sent(core.on_cache_done(freed=1234), "ack")
    assert ack.op == "clear" and ack.freed == 1234 and ack.gen == 1
    (ex,) = [a for a in core.on_task(*task(1, gen=1), 1.0) if isinstance(a, Execute)]
    assert "cleared" in ex.refuse
    core.on_finished(1, 1, RankOutcome.FAILED, 0, 1)
    acts = core.on_control(control("resume", 3, gen=1, layout=LAYOUT.with_changes(gpu_blocks=8).to_wire()), 1.0)
    (alloc,) = [a for a in acts if isinstance(a, AllocateCache)]
    assert alloc.layout.gpu_blocks == 8 and sent(acts, "ack") == []
    (ack,) = sent(core.on_cache_done(), "ack")
    assert ack.op == "resume" and ack.layout.gpu_blocks == 8


def test_a_header_of_a_message_of_tasks_is_a_task_header_only():
    """The first frame of each pair is a ``task`` (docs/protocol.md §10.3): a
    welcome or a reregister there is a bad message, never obeyed."""
    core = welcomed()
    session = core.registration.session
    for header in (
        P.encode("welcome", epoch=5, op="pause", gen=0, upto=0, layout=LAYOUT.to_wire(), heartbeat_ms=100),
        P.encode("reregister"),
    ):
        assert core.on_task(header, P.encode_body("swap_out", [0], [0]), 1.0) == []
    assert core.counters["bad_broker_msgs"] == 2
    assert core.registration.session == session and not core.paused and core.inflight == 0


def test_task_from_another_generation_is_refused():
    core = welcomed(gen=3)
    (ex,) = [a for a in core.on_task(*task(1, gen=2), 1.0) if isinstance(a, Execute)]
    assert "generation" in ex.refuse


def test_welcome_while_cleared_frees_the_fresh_cache_and_acks():
    core = RankCore(0, 2, LAYOUT, sessions=itertools.count(1).__next__)
    core.start(1.0)
    acts = core.on_broker(
        P.encode("welcome", epoch=5, op="clear", gen=2, upto=0, layout=LAYOUT.to_wire(), heartbeat_ms=100), 1.0
    )
    assert any(isinstance(a, FreeCache) for a in acts)
    (ack,) = sent(core.on_cache_done(freed=10), "ack")
    assert ack.epoch == 5 and core.gen == 2


def test_silent_broker_makes_the_rank_register_again_with_a_new_session():
    core = welcomed()
    session = core.registration.session
    assert sent(core.on_tick(1.05), "ready") == []
    (ready,) = sent(core.on_tick(1.0 + core.registration.liveness_ms / 1000 + 0.01), "ready")
    assert ready.session != session and not core.registered


def test_a_repeated_clear_ack_still_carries_the_bytes_freed():
    core = welcomed()
    core.on_control(control("pause", 1), 1.0)
    core.on_control(control("clear", 2, gen=1), 1.0)
    core.on_cache_done(freed=777)
    (ack,) = sent(core.on_control(control("clear", 2, gen=1), 1.0), "ack")
    assert ack.freed == 777


def test_a_frozen_rank_holds_tasks_until_the_broker_says_whether_it_is_still_its_rank():
    core = welcomed()
    old = core.registration.session
    core.on_wake(1.1)
    assert core.on_wake(1.1 + core.registration.liveness_ms / 2000 - 0.05) == []
    (probe,) = sent(core.on_wake(1.1 + core.registration.liveness_ms / 1000), "hb")
    assert probe.probe is True and core.counters["frozen"] == 1
    header = P.encode("task", seq=1, n=1, task=1, reply_to="ipc:///sim/c", gen=0, session=old)
    body = P.encode_body("swap_out", [0], [0])
    assert core.on_task(header, body, 5.0) == [], "held: maybe the broker already failed it"
    # the broker had declared us dead: register again; the held task is refused
    acts = core.on_broker(P.encode("reregister"), 5.0)
    (ready,) = sent(acts, "ready")
    (ex,) = [a for a in acts if isinstance(a, Execute)]
    assert ready.session != old and "earlier registration" in ex.refuse


def test_a_frozen_rank_still_registered_runs_its_held_tasks():
    core = welcomed()
    core.on_wake(1.0)
    sent(core.on_wake(1.0 + core.registration.liveness_ms / 1000), "hb")
    header = P.encode("task", seq=1, n=1, task=1, reply_to="ipc:///sim/c", gen=0, session=core.registration.session)
    assert core.on_task(header, P.encode_body("swap_out", [0], [0]), 5.0) == []
    (ex,) = [a for a in core.on_broker(P.encode("hb", probe=True), 5.0) if isinstance(a, Execute)]
    assert ex.refuse == "" and ex.task == 1 and not core.registration.probing


def test_a_rank_frozen_before_its_welcome_probes_at_the_welcome_and_runs_nothing_of_a_registration_given_up():
    """Its welcome and the tasks sent with it waited out the freeze: the broker may have
    declared it dead meanwhile and failed them (then moved on to another generation)."""
    core = RankCore(0, 2, LAYOUT, sessions=itertools.count(1).__next__)
    core.start(1.0)
    old = core.registration.session
    assert core.on_wake(1.0 + core.registration.liveness_ms / 1000) == [], "joining: nothing to probe yet"
    welcome = {
        "epoch": 0,
        "op": "run",
        "gen": 0,
        "upto": 0,
        "layout": LAYOUT.to_wire(),
        "heartbeat_ms": 100,
        "session": old,
    }
    (hello,) = sent(core.on_broker(P.encode("welcome", **welcome), 5.0), "hb")
    assert hello.probe is True and core.registration.probing, "is this registration still the broker's?"
    header = P.encode("task", seq=1, n=1, task=1, reply_to="ipc:///sim/c", gen=0, session=old)
    assert core.on_task(header, P.encode_body("swap_out", [0], [0]), 5.0) == [], "held until the answer"
    acts = core.on_broker(P.encode("reregister"), 5.0)  # it was given up on
    (ex,) = [a for a in acts if isinstance(a, Execute)]
    assert "earlier registration" in ex.refuse and sent(acts, "ready")


def test_a_rank_that_joined_without_a_freeze_is_not_probed():
    core = RankCore(0, 2, LAYOUT, sessions=itertools.count(1).__next__)
    core.start(1.0)
    core.on_wake(1.0 + core.registration.liveness_ms / 4000)
    welcome = {"epoch": 0, "op": "run", "gen": 0, "upto": 0, "layout": LAYOUT.to_wire(), "heartbeat_ms": 100}
    (hello,) = sent(core.on_broker(P.encode("welcome", **welcome), 1.5), "hb")
    assert not hello.probe and not core.registration.probing


def test_released_tasks_come_after_the_resume_ack():
    core = welcomed()
    core.on_control(control("pause", 1), 1.0)
    core.on_task(*task(1), 1.0)  # held
    acts = core.on_control(control("resume", 2), 1.0)
    kinds = [type(a).__name__ for a in acts]
    assert kinds.index("Acked") < kinds.index("Execute"), kinds


def test_the_phase_moves_joining_registered_probing_and_back():
    from zkv.rank.registration import RankPhase

    core = RankCore(0, 2, LAYOUT, sessions=itertools.count(1).__next__)
    core.start(1.0)
    assert core.registration.phase is RankPhase.JOINING and not core.registered
    assert core.on_control(control("pause", 3), 1.0) == [] and core.counters["control_before_welcome"] == 1
    core.on_broker(
        P.encode("welcome", epoch=0, op="run", gen=0, upto=0, layout=LAYOUT.to_wire(), heartbeat_ms=100), 1.0
    )
    assert core.registration.phase is RankPhase.REGISTERED and core.acked_epoch is None
    core.on_wake(1.0)
    core.on_wake(1.0 + core.registration.liveness_ms / 1000)
    assert core.registration.phase is RankPhase.PROBING and core.registered
    core.on_broker(P.encode("hb", probe=True), 5.0)
    assert core.registration.phase is RankPhase.REGISTERED
    core.on_wake(5.0 + core.registration.liveness_ms / 1000)
    core.on_broker(P.encode("reregister"), 9.0)
    assert core.registration.phase is RankPhase.JOINING


def test_a_welcome_at_a_lower_epoch_is_still_applied():
    core = welcomed(op="run", epoch=5)
    core.on_broker(P.encode("reregister"), 2.0)
    core.on_broker(
        P.encode(
            "welcome",
            epoch=1,
            op="pause",
            gen=0,
            upto=0,
            layout=LAYOUT.to_wire(),
            heartbeat_ms=100,
            session=core.registration.session,
        ),
        2.0,
    )
    assert core.epoch == 1 and core.op == "pause" and core.acked_epoch == 1
