"""The fleet's driver (zkv/fleet/driver.py) on stand-in buses that answer when
the test says: every bus is asked at once (a barrier only all of them
together can pass), a failed pause resumes the buses that acked before the
slow ones answer, and a bus whose thread is stuck past every bound is named
without holding the others paused."""

from __future__ import annotations

import threading
import time

import pytest

from zkv.fleet import driver
from zkv.fleet.decision import Answer, BusAnswer, FleetOp
from zkv.fleet.report import FleetReport
from zkv.fleet.spec import BusSpec


class StandIn(driver.BusLink):
    """A bus whose answers come from ``script(kind)``, on the link's real thread."""

    def __init__(self, name, script):
        super().__init__(BusSpec(name, f"ipc:///tmp/{name}.sock"))
        self.script = script
        self.asked: list[str] = []

    def ask(self, kind, fields, deadline, t0):
        self.asked.append(kind)
        answer = self.script(kind)
        return BusAnswer(answer, (time.monotonic() - t0) * 1000, "rank_dead" if answer is Answer.ERROR else "")


def run(links, op="pause", timeout=5.0, rollback=5.0, close=True):
    t0 = time.monotonic()
    try:
        fleet_op = FleetOp(op, [link.spec.name for link in links])
        return driver.run(links, fleet_op, {}, t0 + timeout, rollback, t0, lambda f: FleetReport.of(f, {}, 0.0))
    finally:
        for link in links if close else ():
            link.close()


def test_every_bus_is_asked_at_once():
    barrier = threading.Barrier(8, timeout=5)  # broken (and the test failed) unless all 8 wait together

    def script(kind):
        barrier.wait()
        return Answer.OK

    report = run([StandIn(f"b{i}", script) for i in range(8)])
    assert report.ok and not barrier.broken


def test_a_failed_pause_resumes_the_acked_buses_before_the_slow_one_answers():
    fast_resumed = threading.Event()

    def fast(kind):
        if kind == "resume":
            fast_resumed.set()
        return Answer.OK

    def slow(kind):
        if kind == "pause":
            assert fast_resumed.wait(5), "the acked bus was not resumed while this one was still pausing"
        return Answer.OK

    links = [StandIn("fast", fast), StandIn("bad", lambda kind: Answer.ERROR), StandIn("slow", slow)]
    report = run(links)
    assert not report.ok and report["fast"].resumed and report["slow"].resumed
    assert [link.asked for link in links] == [["pause", "resume"], ["pause"], ["pause", "resume"]]


def test_a_bus_stuck_past_every_bound_is_named_and_the_others_are_resumed(monkeypatch):
    monkeypatch.setattr(driver, "JOIN_GRACE_S", 0.05)
    release = threading.Event()

    def stuck(kind):
        release.wait(10)
        return Answer.OK

    links = [StandIn("ok", lambda kind: Answer.OK), StandIn("stuck", stuck)]
    start = time.monotonic()
    try:
        report = run(links, timeout=0.2, rollback=0.2, close=False)
        assert time.monotonic() - start < 0.2 + 0.2 + 2 * 0.05 + 0.5
    finally:
        release.set()
        for link in links:
            link.close()
    assert report["stuck"].answer.answer is Answer.NO_REPLY and report["stuck"].not_resumable
    assert "its thread was still busy" in report["stuck"].answer.reason
    assert report["ok"].resumed and links[0].asked == ["pause", "resume"]


@pytest.mark.parametrize("op", ["clear", "resume", "status"])
def test_nothing_is_rolled_back_but_a_pause(op):
    links = [StandIn("a", lambda kind: Answer.OK), StandIn("b", lambda kind: Answer.ERROR)]
    report = run(links, op=op)
    assert not report.ok and [link.asked for link in links] == [[op], [op]]


def test_a_bug_in_a_bus_s_request_is_its_answer_not_a_dead_thread():
    def broken(kind):
        raise RuntimeError("boom")

    report = run([StandIn("a", broken), StandIn("b", lambda kind: Answer.OK)])
    assert report["a"].answer.code == "internal" and "RuntimeError: boom" in report["a"].answer.reason
    assert report["b"].resumed
