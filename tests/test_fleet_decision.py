"""The fleet's decisions without sockets (zkv/fleet/decision.py, report.py):
all or nothing over every combination of per-bus answers, in any order, and
the rule of a failed pause: every bus that acked (or did not answer) is
resumed, or reported as not resumable; no other bus is touched."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zkv.fleet.decision import OPS, Answer, BusAnswer, FleetOp, Step
from zkv.fleet.report import FleetError, FleetReport
from zkv.wire.replies import ControlReply
from zkv.wire.vocab import ControlOp

ERROR_CODES = ("pause_timeout", "rank_dead", "busy", "not_paused", "clear_timeout", "resume_timeout", "internal")


def answer(kind: Answer, code: str = "", at: float = 1.0, reason: str = "") -> BusAnswer:
    if kind is Answer.ERROR:
        return BusAnswer(kind, at, code or "rank_dead", reason or "rank 1 went silent")
    if kind in (Answer.OK, Answer.NOOP):
        fields = {"state": "paused", **({"noop": True} if kind is Answer.NOOP else {})}
        reply = ControlReply(1, fields, control=ControlOp.PAUSE, state="paused", noop=kind is Answer.NOOP)
        return BusAnswer(kind, at, reply=reply)
    return BusAnswer(kind, at, str(kind), f"{kind} within 1 s")


answers = st.builds(
    answer, st.sampled_from(list(Answer)), st.sampled_from(ERROR_CODES), st.floats(0, 5000, allow_nan=False)
)


def check_report(op: FleetOp, report: FleetReport) -> None:
    """What every report of a settled operation must say."""
    assert report.ok == all(op.answers[n].ok for n in op.names)
    message = report.message()
    assert all(n in message for n in op.names), message
    for bus in report.buses:
        a = op.answers[bus.name]
        rolls = (
            op.op == "pause"
            and op.on_failure == "resume"
            and not report.ok
            and a.answer in (Answer.OK, Answer.NO_REPLY)
        )
        assert bus.needed_rollback == rolls, (bus, op.op)
        if rolls:
            # The rule: a bus a failed pause may have paused is resumed, or named as not resumable.
            assert bus.resumed != bus.not_resumable
            assert bus.rollback is not None
            assert (bus.state == "running") == bus.resumed
            if bus.not_resumable:
                assert bus.name in message and "NOT RESUMED" in message
        else:
            assert bus.rollback is None and not bus.not_resumable
        if a.answer is Answer.NOOP and op.op == "pause":
            assert bus.state == "paused"  # already paused before the call: left where it was
        if not report.ok and op.op == "pause" and op.on_failure == "stay" and a.answer is Answer.OK:
            assert bus.state == "paused"
    if not report.ok and op.op != "status":
        err = FleetError(report)
        assert err.code == f"fleet_{op.op}_failed" and err.report is report


class FleetOpMachine(RuleBasedStateMachine):
    """Answers arrive in any order; rollbacks are sent whenever a bus is told to."""

    @initialize(op=st.sampled_from(OPS), n=st.integers(1, 5), on_failure=st.sampled_from(["resume", "stay"]))
    def start(self, op: str, n: int, on_failure: str) -> None:
        self.op = FleetOp(op, [f"bus{i}" for i in range(n)], on_failure)
        self.was_failed = False

    def pending(self) -> list[str]:
        return [n for n in self.op.names if n not in self.op.answers]

    def to_roll(self) -> list[str]:
        return [n for n in self.op.names if self.op.step(n) is Step.ROLLBACK]

    @precondition(lambda self: self.pending())
    @rule(data=st.data(), a=answers)
    def bus_answers(self, data: st.DataObject, a: BusAnswer) -> None:
        name = data.draw(st.sampled_from(self.pending()))
        self.op.answered(name, a)
        with pytest.raises(ValueError):
            self.op.answered(name, a)  # one answer per bus

    @precondition(lambda self: self.to_roll())
    @rule(data=st.data(), a=answers)
    def rollback_answers(self, data: st.DataObject, a: BusAnswer) -> None:
        name = data.draw(st.sampled_from(self.to_roll()))
        self.op.rolled_back(name, a)
        assert self.op.step(name) is Step.DONE

    @rule()
    def nothing_arrives(self) -> None:
        """Time passes: asking again changes nothing (a step is a pure function of the answers)."""
        before = [self.op.step(n) for n in self.op.names]
        assert [self.op.step(n) for n in self.op.names] == before

    @invariant()
    def steps_follow_the_rules(self) -> None:
        op = self.op
        self.was_failed |= op.failed
        assert op.failed == self.was_failed  # a failure is never forgotten
        for name in op.names:
            step, a = op.step(name), op.answers.get(name)
            if step is Step.ROLLBACK:
                assert op.op == "pause" and op.on_failure == "resume" and op.failed
                assert a is not None and a.answer in (Answer.OK, Answer.NO_REPLY) and name not in op.rollbacks
            if step is Step.WAIT:
                # waiting only for its own answer, or (acked) for the fleet's outcome
                assert a is None or (op.needs_rollback(name) and not op.failed and not op.all_answered)
            if name in op.rollbacks:
                assert op.failed
        if op.all_answered:
            assert all(op.step(n) is not Step.WAIT for n in op.names)

    @invariant()
    def a_settled_operation_reports_every_bus(self) -> None:
        if self.op.all_answered and self.op.settled:
            check_report(self.op, FleetReport.of(self.op, {}, 10.0))


TestFleetOpMachine = FleetOpMachine.TestCase
TestFleetOpMachine.settings = settings(max_examples=150, stateful_step_count=20, deadline=None)


def drive(op: FleetOp, forward: list[BusAnswer], backs: list[BusAnswer]) -> FleetReport:
    for name, a in zip(op.names, forward):
        op.answered(name, a)
    for name, back in zip([n for n in op.names if op.step(n) is Step.ROLLBACK], itertools.cycle(backs)):
        op.rolled_back(name, back)
    assert op.settled
    return FleetReport.of(op, {}, 5.0)


@settings(max_examples=250, deadline=None)
@given(forward=st.lists(answers, min_size=1, max_size=6), backs=st.lists(answers, min_size=1, max_size=6))
def test_after_a_failed_pause_every_bus_that_acked_is_resumed_or_reported(forward, backs):
    op = FleetOp("pause", [f"b{i}" for i in range(len(forward))])
    report = drive(op, forward, backs)
    check_report(op, report)
    acked = [b for b in report.buses if b.answer.answer is Answer.OK]
    if not report.ok:
        assert all(b.resumed or b.name in {x.name for x in report.not_resumable()} for b in acked)
    else:
        assert all(b.rollback is None and b.state == "paused" for b in acked)


def test_every_combination_of_three_buses_and_their_rollbacks():
    kinds = list(Answer)
    for combo in itertools.product(kinds, repeat=3):
        for back in kinds:
            for on_failure in ("resume", "stay"):
                op = FleetOp("pause", ["a", "b", "c"], on_failure)
                check_report(op, drive(op, [answer(k) for k in combo], [answer(back)]))


def test_an_acked_bus_waits_for_the_others_and_rolls_back_as_soon_as_one_fails():
    op = FleetOp("pause", ["a", "b", "c"])
    op.answered("a", answer(Answer.OK))
    assert op.step("a") is Step.WAIT and op.step("b") is Step.WAIT
    op.answered("b", answer(Answer.ERROR, "rank_dead"))
    assert op.step("a") is Step.ROLLBACK  # before c answered: a is resumed at once
    assert op.step("b") is Step.DONE and op.state_after("b") == "running"  # the broker runs it again
    op.answered("c", answer(Answer.NO_REPLY))
    assert op.step("c") is Step.ROLLBACK  # its pause may have completed
    op.rolled_back("a", answer(Answer.OK))
    op.rolled_back("c", answer(Answer.UNREACHABLE))
    report = FleetReport.of(op, {"c": "ipc:///x"}, 12.0)
    assert [b.name for b in report.not_resumable()] == ["c"]
    assert report["a"].state == "running" and report["c"].state is None
    text = report.message()
    assert text.startswith("fleet pause failed on 2 of 3 buses, 1 left not running: c")
    assert "b: rank_dead: rank 1 went silent; now running" in text
    assert report.to_json()["buses"][2] == {
        "bus": "c",
        "broker": "ipc:///x",
        "outcome": "no_reply",
        "ms": 1.0,
        "reason": "no_reply within 1 s",
        "rollback": "unreachable",
        "rollback_ms": 1.0,
        "rollback_reason": "unreachable within 1 s",
    }


def test_a_successful_pause_rolls_nothing_back_and_names_the_slowest():
    op = FleetOp("pause", ["a", "b"])
    op.answered("a", answer(Answer.OK, at=3.0))
    op.answered("b", answer(Answer.NOOP, at=9.5))
    assert op.settled and not op.rollbacks
    report = FleetReport.of(op, {}, 10.0)
    assert report.ok and report.slowest().name == "b" and report.to_json()["slowest"] == "b"


@pytest.mark.parametrize(
    "op,a,state",
    [
        ("clear", answer(Answer.ERROR, "clear_timeout"), "cleared"),  # a failed clear stays cleared
        ("clear", answer(Answer.ERROR, "not_paused"), None),
        ("resume", answer(Answer.ERROR, "alloc_failed", reason="rank 0 ...; the bus is cleared again"), "cleared"),
        ("resume", answer(Answer.ERROR, "resume_timeout", reason="...; the bus is paused again"), "paused"),
        ("resume", answer(Answer.NO_REPLY), None),
    ],
)
def test_what_a_failed_clear_or_resume_leaves(op, a, state):
    fleet_op = FleetOp(op, ["x"])
    fleet_op.answered("x", a)
    assert fleet_op.settled and fleet_op.step("x") is Step.DONE  # nothing rolled back
    assert fleet_op.state_after("x") == state


def test_a_bus_that_never_answered_is_reported_as_such():
    op = FleetOp("pause", ["a", "b"])
    op.answered("a", answer(Answer.OK))
    report = FleetReport.of(op, {}, 2000.0)
    assert not report.ok and report["b"].answer.answer is Answer.NO_REPLY
    assert report["b"].not_resumable and "no answer before the fleet's deadline" in report.message()


@pytest.mark.parametrize(
    "args,complaint",
    [(("pause", []), "one or more"), (("pause", ["a", "a"]), "distinct"), (("reboot", ["a"]), "unknown")],
)
def test_a_bad_operation_is_refused(args, complaint):
    with pytest.raises(ValueError, match=complaint):
        FleetOp(*args)
    with pytest.raises(ValueError, match="on_failure"):
        FleetOp("pause", ["a"], "ignore")
