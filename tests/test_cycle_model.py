"""The RL cycle's core (zkv/cycle/core.py), driven by a model of N stand-in
engines with faults injected at every step, the invariants of a fleet's RL
cycle (docs/engine-vllm.md, "The RL cycle") checked after every step:

- at the end every engine serves the new weights with consistent rows, or
  the old ones with its rows intact (a committed or rolled-back cycle);
  whatever the outcome, an engine that serves holds no KV of other weights;
- no engine is left paused (or hung) without the report saying so and
  naming the command that finishes it; what the report says an engine
  serves and answers is what it does;
- one deadline bounds the whole cycle, rollback included;
- running the same id again after the driver died finishes the cycle or
  rolls it back; a second driver is refused while one holds the fleet.

The stand-in engines are the calls of ``runner.ACTIONS`` on plain objects:
the model runs the same step table and the same calls a real fleet does,
with a clock it moves.  ``ZKV_LONG_MODEL=1`` runs the long profile."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zkv.cycle import label as L
from zkv.cycle.core import DONE, GRACE_S, WAIT, Call, CycleCore, Decision
from zkv.cycle.engine import Look, Staged, StepFailed
from zkv.cycle.plan import CyclePlan
from zkv.cycle.runner import invoke
from zkv.cycle.sources import Update
from zkv.cycle.terms import Outcome, Reach, Serves, State, Step, Tiers

LONG = os.environ.get("ZKV_LONG_MODEL") == "1"
pytestmark = pytest.mark.timeout(3600 if LONG else 900)
OLD, NEW = "w0", "w1"
FAULTS = ["ok", "error", "down_before", "down_after", "hung_before", "hung_after", "bus_error", "bus_gone"]


@dataclass
class SimEngine:
    """A stand-in engine and its bus: what it really holds (weights, label, pause, rows)."""

    name: str
    clears_before_update: bool = False
    version: str = OLD
    label: str | None = "default"
    paused: bool = False
    up: bool = True
    hung: bool = False
    bus: str = "running"
    kept: bool = False  # the bus's last clear kept its CPU tier (a reset then keeps the rows)
    named: str | None = None  # the name its bus's last clear without keep_cpu gave the weights
    rows: list[str] = field(default_factory=list)  # zkv's tier rows: the weights each was computed under
    vcache: set[str] = field(default_factory=set)  # the engine's own prefix cache
    fault: str = "ok"  # what the next call meets

    # --- the engine protocol ----------------------------------------------------------

    def _enter(self, bus: bool = False) -> str:
        if not self.up:
            raise StepFailed("refused", Reach.DOWN if not bus else Reach.BUS, sent=False)
        if self.hung:
            raise StepFailed("no answer", Reach.HUNG if not bus else Reach.BUS)
        fault, self.fault = self.fault, "ok"
        if bus:
            if fault == "bus_error":
                raise StepFailed("bus refused", Reach.BUS)
            if fault == "bus_gone":
                raise StepFailed("bus unreachable", Reach.BUS, sent=False)
            return "ok"
        if fault == "error":
            raise StepFailed("answered an error")
        if fault == "down_before":
            self.die()
            raise StepFailed("refused", Reach.DOWN, sent=False)
        if fault == "hung_before":
            self.hung = True
            raise StepFailed("no answer", Reach.HUNG)
        return fault

    def _leave(self, fault: str) -> None:
        if fault == "down_after":
            self.die()
            raise StepFailed("connection lost", Reach.DOWN)
        if fault == "hung_after":
            self.hung = True
            raise StepFailed("no answer", Reach.HUNG)

    def die(self) -> None:
        self.up = False

    def look(self, sleep: bool, timeout: float) -> Look:
        self._leave(self._enter())
        return Look(self.paused, self.label)

    def model_path(self, timeout: float) -> str | None:
        return None

    def set_label(self, label: str, timeout: float) -> None:
        f = self._enter()
        self.label = label
        self._leave(f)

    def stop(self, mode, sleep, timeout) -> None:  # noqa: ANN001
        f = self._enter()
        self.paused = True
        self._leave(f)

    def start(self, sleep, timeout) -> None:  # noqa: ANN001
        f = self._enter()
        self.paused = False
        self._leave(f)

    def reload_weights(self, path: str, timeout: float) -> None:
        f = self._enter()
        self.version = path  # vLLM's own prefix cache is not touched: a reset must follow
        self._leave(f)

    def weights(self, timeout: float) -> str:
        f = self._enter()
        self._leave(f)
        return self.version

    def reset(self, running: bool, external: bool, timeout: float) -> bool:
        f = self._enter()
        self.vcache.clear()
        if external and not self.kept:
            self.rows.clear()
        self.kept = False
        self._leave(f)
        return True

    def pause_bus(self, timeout: float) -> None:
        self._enter(bus=True)
        if self.bus == "running":
            self.bus = "paused"

    def clear_bus(self, keep_cpu: bool, timeout: float, weights: str | None = None) -> Tiers:
        self._enter(bus=True)
        if self.bus == "running":
            raise StepFailed("not_paused", Reach.BUS)
        if self.bus == "paused":
            self.bus = "cleared"
            if not keep_cpu:
                self.named = weights  # whose the KV stored from now on is (the bus says it)
            if self.clears_before_update or not keep_cpu:
                self.rows.clear()  # a prefix manager forgets every block at any clear
            else:
                self.kept = True
        return Tiers.DROPPED if self.clears_before_update or not keep_cpu else Tiers.KEPT

    def resume_bus(self, timeout: float) -> None:
        self._enter(bus=True)
        self.bus = "running"

    def close(self) -> None:
        pass

    # --- the model's view -------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self.up and not self.hung and not self.paused

    def traffic(self) -> None:
        """A request served now stores KV under the weights it runs."""
        self.vcache.add(self.version)
        if self.bus == "running":
            self.rows.append(self.version)

    def restart(self) -> None:
        """Started again from its command line: its checkpoint (the old weights), no label, no rows."""
        self.up, self.hung, self.paused, self.version, self.label = True, False, False, OLD, "default"
        self.bus, self.kept, self.rows, self.vcache = "running", False, [], set()


@dataclass(frozen=True)
class SimSource:
    """Weights ``version``, staged by asking the engine (a stage meets the engine's next fault)."""

    version: str

    def apply(self, engine: SimEngine, timeout: float) -> None:
        engine.reload_weights(self.version, timeout)

    def stage(self, engine: SimEngine, timeout: float) -> Staged:
        if engine._enter() != "ok":
            raise StepFailed("the checkpoint does not check", sent=False)
        return Staged(f"digest-{self.version}", 1)


def _load(version: str) -> Update:
    return Update(lambda engine, timeout: engine.reload_weights(version, timeout))


class CycleModel(RuleBasedStateMachine):
    @initialize(
        n=st.integers(2, 4),
        prefix=st.booleans(),
        unchanged=st.sampled_from([None, OLD, NEW]),
        rollback=st.booleans(),
        depth=st.integers(0, 60),
        order=st.randoms(use_true_random=False),
    )
    def start(self, n: int, prefix: bool, unchanged: str | None, rollback: bool, depth: int, order) -> None:  # noqa: ANN001
        """``unchanged``: the caller says the weights do not change, loading OLD (true) or NEW (a lie);
        the cycle then runs ``depth`` calls without faults (lanes in a random order), so that the
        faults the rules inject land at every step of it."""
        self.engines = {f"e{i}": SimEngine(f"e{i}", clears_before_update=prefix and i == 0) for i in range(n)}
        for e in self.engines.values():
            e.traffic()
        self.target = unchanged or NEW
        source = SimSource(self.target)
        self.plan = CyclePlan(
            "c1",
            dict.fromkeys(self.engines, source),
            {name: _load(OLD) for name in self.engines} if rollback else {},
            weights_changed=unchanged is None,
            deadline_s=60.0,
            call_timeout=10.0,
            look_s=2.0,
        )
        self.now = 0.0
        self.pid = 1000
        self.dead_pids: set[int] = set()
        self.before = {name: list(e.rows) for name, e in self.engines.items()}
        self.restarted: set[str] = set()
        self.at_start = self._states()
        self.report = None
        self.core = self._driver()
        names = list(self.engines)
        for _ in range(depth):
            if self.report is not None:
                break
            self._one(order.choice(names), "ok", 0.01)
            if self.core.finished:
                self._finish()

    def _states(self) -> dict[str, tuple]:
        return {n: (e.label, e.paused, e.version, e.bus, list(e.rows)) for n, e in self.engines.items()}

    def _driver(self, alive: bool = False) -> CycleCore:
        self.pid += 1
        clears = {n: e.clears_before_update for n, e in self.engines.items()}

        def is_alive(record: L.CycleRecord) -> bool:
            return alive or (record.pid not in self.dead_pids and record.pid != self.pid)

        return CycleCore(self.plan, clears, self.now, 1e9 + self.now, host="sim", pid=self.pid, alive=is_alive)

    # --- driving the core -------------------------------------------------------------

    def _one(self, name: str, fault: str, dt: float) -> bool:
        """One call of lane ``name`` (if it has one), meeting ``fault``; False when it had none."""
        core = self.core
        call = core.next(name, self.now)
        if call == WAIT or call == DONE:
            return False
        assert isinstance(call, Call)
        assert self.now + call.timeout <= core.end + 1e-9, (call, self.now, core.end)
        engine = self.engines[name]
        engine.fault = fault
        hangs = engine.hung or fault in ("hung_before", "hung_after")
        value, failure, sent = invoke(engine, call, self.plan)  # type: ignore[arg-type]
        engine.fault = "ok"
        if hangs and failure is not None and failure[1] is Reach.HUNG and dt == 3.0:
            self.now = max(self.now, core.lanes[name].bound)  # nothing answers: the runner gives the call up
            core.tick(self.now)
            core.done(name, self.now, value, failure, sent)  # its late "answer" changes nothing
        elif hangs and failure is not None and failure[1] is Reach.HUNG:
            self.now += max(0.0, call.timeout)  # the call's own bound ends it
            core.done(name, self.now, value, failure, sent)
        else:
            self.now += min(dt, max(0.0, call.timeout))
            core.done(name, self.now, value, failure, sent)
        return True

    @rule(
        lanes=st.lists(st.integers(0, 3), min_size=1, max_size=12),
        fault=st.sampled_from(FAULTS),
        at=st.integers(0, 11),
        dt=st.sampled_from([0.0, 0.01, 0.5, 3.0]),
    )
    def advance(self, lanes: list[int], fault: str, at: int, dt: float) -> None:
        """A few calls, of the lanes named in turn; the call ``at`` meets ``fault``."""
        names = list(self.engines)
        for k, i in enumerate(lanes):
            if self.report is not None:
                return
            self._one(names[i % len(names)], fault if k == at else "ok", dt)
            if self.core.finished:
                self._finish()

    @rule(i=st.integers(0, 3))
    def traffic(self, i: int) -> None:
        engine = list(self.engines.values())[i % len(self.engines)]
        if engine.serving:
            engine.traffic()

    @rule(i=st.integers(0, 3))
    def unhang(self, i: int) -> None:
        list(self.engines.values())[i % len(self.engines)].hung = False

    @rule()
    def time_passes(self) -> None:
        if self.report is None:
            self.now = self.core.next_wakeup()
            self.core.tick(self.now)

    @precondition(lambda self: self.report is None and len(self.core.records) > 12)
    @rule()
    def run_out_the_clock(self) -> None:
        """Past the deadline nothing is left running."""
        if self.report is None:
            self.now = self.core.end + GRACE_S
            self.core.tick(self.now)
            assert self.core.finished, "the deadline bounds the whole cycle"
            self._finish()

    @precondition(lambda self: self.report is None and len(self.core.records) > 4)
    @rule()
    def the_driver_dies(self) -> None:
        """The trainer dies mid-cycle: its core is gone; the engines keep what it did."""
        self.dead_pids.add(self.pid)
        self.core = self._driver()

    @precondition(lambda self: self.report is None)
    @rule(same_id=st.booleans())
    def a_second_driver_is_refused(self, same_id: bool) -> None:
        claimed = any(L.is_record(e.label) for e in self.engines.values() if e.up)
        if not claimed or any(not e.up or e.hung for e in self.engines.values()):
            return
        plan = self.plan if same_id else CyclePlan("c2", self.plan.sources, deadline_s=60.0, stage=False)
        states = {n: (e.label, e.paused, e.version, e.bus) for n, e in self.engines.items()}
        clears = {n: e.clears_before_update for n, e in self.engines.items()}
        other = CycleCore(plan, clears, self.now, 1e9, host="sim", pid=99999, alive=lambda record: True)
        for _ in range(3 * len(self.engines)):
            for name, engine in self.engines.items():
                call = other.next(name, self.now)
                if isinstance(call, Call):
                    value, failure, sent = invoke(engine, call, plan)  # type: ignore[arg-type]
                    other.done(name, self.now, value, failure, sent)
        assert other.decision is Decision.REFUSE and other.busy is not None, "a second driver is refused"
        assert states == {n: (e.label, e.paused, e.version, e.bus) for n, e in self.engines.items()}

    def teardown(self) -> None:
        if hasattr(self, "engines"):
            self.finish_it()

    def finish_it(self) -> None:
        """Every engine back (restarted or answering again), the cycle run to its end without faults; if
        it is left incomplete, its own id run again by a new driver commits it or rolls it back."""
        for name, e in self.engines.items():
            if not e.up:
                e.restart()
                self.restarted.add(name)
            e.hung = False
        if self.report is None:
            self._run_clean()
        if self.report.outcome in (Outcome.INCOMPLETE,):  # type: ignore[union-attr]
            self.dead_pids.add(self.pid)
            self.core = self._driver()
            self.report = None
            self._run_clean()
            assert self.report.outcome in (Outcome.COMMITTED, Outcome.ROLLED_BACK), self.report.describe()

    def _run_clean(self) -> None:
        for _ in range(200):
            if self.core.finished:
                break
            before = [lane.pos for lane in self.core.lanes.values()]
            progressed = False
            for name in self.engines:
                progressed |= self._one(name, "ok", 0.01)
            if not progressed and before == [lane.pos for lane in self.core.lanes.values()]:
                self.now = self.core.next_wakeup()
                self.core.tick(self.now)
        assert self.core.finished, "a cycle without faults ends"
        self._finish()

    def _finish(self) -> None:
        if self.report is None:
            self.report = self.core.report(self.now)
            self._check_the_end()

    # --- the invariants ---------------------------------------------------------------

    @invariant()
    def a_serving_engine_holds_no_kv_of_other_weights(self) -> None:
        for e in self.engines.values():
            if e.serving:
                assert all(r == e.version for r in e.rows), (e.name, e.version, e.rows)
                assert all(v == e.version for v in e.vcache), (e.name, e.version, e.vcache)

    @invariant()
    def no_engine_serves_weights_between_versions(self) -> None:
        for e in self.engines.values():
            assert e.version in (OLD, NEW)

    def _check_the_end(self) -> None:
        report = self.report
        assert report is not None
        assert report.seconds <= self.plan.deadline_s + GRACE_S + 1e-6, "one deadline bounds the whole"
        if report.outcome is Outcome.REFUSED:
            if self.pid == 1001 and not self.restarted:  # the first driver refused: nothing was touched
                now = self._states()
                assert all(now[n][:4] == self.at_start[n][:4] for n in now), (now, self.at_start)
            return
        serving = {e.version for n, e in self.engines.items() if e.serving and n not in self.restarted}
        assert len(serving) <= 1, ("one weight version among the engines that serve", self.engines)
        if report.outcome is Outcome.COMMITTED:
            self._check_committed()
        if report.outcome is Outcome.ROLLED_BACK:
            self._check_rolled_back()
        self._check_the_report_is_the_engines_word()

    def _check_committed(self) -> None:
        report = self.report
        assert report is not None
        for name, e in self.engines.items():
            assert e.serving and e.version == self.target, (e, report.describe())
            assert e.label == self.plan.target_label
            if report.weights_changed is False and not e.clears_before_update:
                assert report.engines[name].tiers is Tiers.KEPT, ("measured unchanged: kept", report.describe())

    def _check_rolled_back(self) -> None:
        report = self.report
        assert report is not None
        for name, e in self.engines.items():
            assert e.serving and e.version == OLD and not L.is_record(e.label), (e, report.describe())
            if not e.clears_before_update and name not in self.restarted:
                assert e.rows[: len(self.before[name])] == self.before[name], ("rows intact", e)

    def _check_the_report_is_the_engines_word(self) -> None:
        report = self.report
        assert report is not None
        left = False
        for name, e in self.engines.items():
            said = report.engines[name]
            if said.state in (State.SERVING, State.PAUSED) and e.up and not e.hung:
                assert (said.state is State.PAUSED) == e.paused, (name, said, e)  # what it answered at the end
            if e.up and (e.paused or e.hung):
                assert said.paused or said.state is not State.SERVING, (name, said, e)
                left = True
            if said.serves is Serves.NEW and e.up:
                assert e.version == self.target, (name, said, e)
            if said.serves is Serves.OLD and e.up:
                assert e.version == OLD, (name, said, e)
        if left or report.outcome is Outcome.INCOMPLETE:
            assert report.finish, report.describe()


CycleModel.TestCase.settings = settings(
    max_examples=2000 if LONG else 150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCycleModel = CycleModel.TestCase


@pytest.mark.parametrize("got_to", ["one-claim", "a-pause"])
def test_a_second_driver_s_rollback_undoes_what_the_first_driver_did(got_to: str) -> None:
    """The first driver claims one engine (or pauses one after claiming both) and dies; a second
    driver of the same id fails its claim of the other before claiming this one again: its
    rollback still gives every engine back serving, under its old label, its bus running."""
    import random

    machine = CycleModel()
    machine.start(n=2, prefix=True, unchanged=None, rollback=False, depth=0, order=random.Random(0))
    e1 = machine.engines["e1"]
    for _ in range(40):
        if e1.paused if got_to == "a-pause" else L.is_record(e1.label):
            break
        machine._one("e1", "ok", 0.01) or machine._one("e0", "ok", 0.01)
    assert L.is_record(e1.label) and e1.paused is (got_to == "a-pause")
    machine.the_driver_dies()
    for name in ("e1", "e0", "e1", "e0", "e1", "e1"):  # both surveyed and staged, e0 the last
        machine._one(name, "ok", 0.01)
    assert machine._one("e0", "error", 0.01)
    failed = machine.core.records[-1]
    assert (failed.step, failed.engine, failed.ok) == (Step.CLAIM, "e0", False)
    machine._run_clean()
    assert machine.report is not None and machine.report.outcome is Outcome.ROLLED_BACK
    for e in machine.engines.values():
        assert e.serving and e.label == "default" and e.bus == "running", e


def test_an_engine_an_earlier_driver_finished_is_reported_on_the_new_weights_by_a_driver_out_of_time() -> None:
    """The first driver commits and finishes e0 (its label the cycle's) and dies before e1's tail;
    a second driver surveys e0 only and runs out of time: its report says e0 serves the new weights."""
    import random

    machine = CycleModel()
    machine.start(n=2, prefix=False, unchanged=None, rollback=False, depth=0, order=random.Random(0))
    e0 = machine.engines["e0"]
    for _ in range(80):
        if e0.label == machine.plan.target_label:
            break
        machine._one("e0", "ok", 0.01) or machine._one("e1", "ok", 0.01)
    assert e0.label == machine.plan.target_label and e0.version == NEW
    assert machine.engines["e1"].label != machine.plan.target_label
    machine.the_driver_dies()
    assert machine._one("e0", "ok", 0.01)  # its survey
    machine.time_passes()
    assert machine.core.finished
    report = machine.core.report(machine.now)
    assert report.outcome is Outcome.INCOMPLETE and report.engines["e0"].serves is Serves.NEW, report.describe()
