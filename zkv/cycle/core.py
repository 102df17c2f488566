"""The cycle's decisions, sans-IO (docs/engine-vllm.md, "The RL cycle"): one
lane per engine, each going through the steps of ``table.py`` on its own,
bounded on its own; the fleet's decisions at three barriers; the report.
The runner (``runner.py``) asks ``next(engine, now)`` for the call a lane
makes, hands the answer to ``done``, and calls ``tick`` when a lane's call
is overdue; tests drive the same core with stand-in engines.

Rule 1: every decision lives here: whether the fleet commits, rolls back or
refuses; which steps a lane runs, skips or undoes; what each engine is left
serving.  A lane never waits on another lane's call: one engine's trouble
never spends another engine's rollback.

Rule 2: the core knows no engine kind and no clock but the ``now`` it is
given; what an engine answered is all it knows of it.

The barriers: every engine surveyed (a cycle in progress under another id,
or driven by another live driver, refuses; so does an engine that does not
answer) → every checkpoint staged (one that does not check refuses: nothing
paused) → every engine claimed (so that they stop together: the pause window
is not spread by their start) → every engine updated (commit; any failure
before rolls every lane back, each as soon as its own call ends).
"""

from __future__ import annotations

import enum
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from . import label as L
from . import table as T
from .engine import Look, Staged
from .plan import CyclePlan
from .report import CycleReport, EngineReport, StepRecord
from .terms import InFlight, Outcome, Phase, Reach, Serves, State, Step, Tiers

#: A call overdue by this much past its own bound is given up (the engine is taken for hung).
GRACE_S = 0.5


class Decision(enum.Enum):
    OPEN = "open"
    COMMIT = "commit"
    ROLLBACK = "rollback"
    REFUSE = "refuse"


class Pos(enum.Enum):
    SURVEY = "survey"
    SURVEYED = "surveyed"  # waiting for every engine's survey
    STAGE = "stage"
    STAGED = "staged"  # waiting for every engine's checkpoint check
    CLAIMING = "claiming"
    CLAIMED = "claimed"  # waiting for every engine's claim: the engines stop together
    FORWARD = "forward"
    BARRIER = "barrier"  # updated, waiting for the fleet's decision
    TAIL = "tail"
    ROLLBACK = "rollback"
    LOOK = "look"
    DONE = "done"


class Start(enum.Enum):
    """Where a lane starts, from what its engine's record says of an earlier driver's run."""

    FULL = "full"  # the whole cycle
    TAIL = "tail"  # the cycle committed and this engine was updated: only the steps after the commit
    CAUGHT_UP = "caught_up"  # the cycle committed and this engine already serves the new label
    CATCH_UP = "catch_up"  # the cycle committed and this engine lost its update (restarted): forward, then tail


@dataclass(frozen=True)
class Call:
    """What one lane asks its engine next, within ``timeout`` seconds."""

    engine: str
    step: Step
    timeout: float
    back: bool = False  # a rollback step
    label: str | None = None  # written to the engine's label (claim, update, commit, label)
    keep_cpu: bool = False  # a bus clear keeps the CPU tier
    running: bool = False  # a reset also drops the running requests' blocks (they are recomputed)
    external: bool = True  # a reset also resets zkv's keys (unless the bus kept them)
    rollback: bool = False  # an update step loads the rollback weights


WAIT = "wait"
DONE = "done"


class _Moved:
    """A lane changed position: ask it again (never a step: ``Step`` s are strings)."""


MOVED = _Moved()
#: Where a lane whose survey or stage call is given up waits for the others.
_WAITS_AT = {Pos.SURVEY: Pos.SURVEYED, Pos.STAGE: Pos.STAGED}
#: A lane's steps before the fleet's decision (a failure there rolls the fleet back).
_FORWARD = (Pos.CLAIMING, Pos.FORWARD)


@dataclass
class Failure:
    step: Step
    why: str
    reach: Reach


@dataclass
class Lane:
    name: str
    shape: T.Shape
    pos: Pos = Pos.SURVEY
    start: Start = Start.FULL
    todo: list[Step] = field(default_factory=list)
    call: Call | None = None
    since: float = 0.0
    bound: float = 0.0  # when the call in flight is overdue
    overdue: bool = False
    started: set[Step] = field(default_factory=set)
    ok: set[Step] = field(default_factory=set)
    failure: Failure | None = None
    gone: Reach | None = None  # DOWN or HUNG: later engine steps are skipped
    record: L.CycleRecord | None = None
    surveyed: Look | None = None
    old_label: str | None = None
    may_be_new: bool = False  # an earlier driver's record said its update had started
    earlier: bool = False  # an earlier driver of this cycle claimed it: it may have run any step before the update
    staged: Staged | None = None
    before: str | None = None
    after: str | None = None
    budget_end: float = 0.0
    behind: bool = False  # it came in behind the fleet's weights (restarted on old ones)
    stopped_at: float | None = None
    served_at: float | None = None
    reset_failed: bool = False
    fate: Tiers | None = None  # what a clear did to the tiers
    looked: Look | None = None
    look_reach: Reach | None = None
    wrote: str | None = None  # the label this driver last wrote (a look that says otherwise: it restarted)
    skipped: set[Step] = field(default_factory=set)  # steps left undone because the engine was gone


def alive_here(record: L.CycleRecord) -> bool:
    """Whether the driver a record names may still be running: a live process of this
    host other than this one (a run of this process is refused before it surveys:
    ``runner.py``), or a driver elsewhere before its deadline."""
    if record.host == socket.gethostname():
        if record.pid == os.getpid():
            return False
        try:
            os.kill(record.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return time.time() < record.until


class CycleBusyInfo(Exception):
    """Another cycle (``other``), or another live driver of this one, holds ``engine``."""

    def __init__(self, other: str, engine: str, why: str):
        super().__init__(why)
        self.other, self.engine, self.why = other, engine, why


class CycleCore:
    """One cycle over ``engines`` (name -> whether it clears its bus before the update)."""

    def __init__(
        self,
        plan: CyclePlan,
        engines: dict[str, bool],
        now: float,
        now_wall: float,
        *,
        host: str | None = None,
        pid: int | None = None,
        alive: Callable[[L.CycleRecord], bool] | None = None,
        finish: tuple[str, list[str] | None] | None = None,
        fleet_label: str | None = None,
    ):
        plan.check_engines(list(engines))
        self.plan = plan
        self.t0 = now
        self.end = now + plan.deadline_s
        self.forward_end = self.end - plan.rollback_window_s
        self.host = host or socket.gethostname()
        self.pid = pid if pid is not None else os.getpid()
        self.until = int(now_wall + plan.deadline_s) + 1
        self._alive = alive
        self.fleet_label = fleet_label  # the label the fleet last committed (version.py), when known
        self.finish = finish or (f"run cycle {plan.cycle_id!r} again (the same call, with the same cycle id)", None)
        measuring = not plan.weights_changed
        self.lanes = {
            n: Lane(n, T.Shape(plan.sleep, measuring, clears), todo=[Step.SURVEY]) for n, clears in engines.items()
        }
        self.decision = Decision.OPEN
        self.busy: CycleBusyInfo | None = None
        self.why = ""
        self.changed: bool | None = None  # measured over the fleet at the commit
        self.records: list[StepRecord] = []
        self.ended_at: float | None = None
        #: Moves whenever a lane waiting for the others may go on (a barrier passed, a decision taken,
        #: a claim done): the runner wakes the waiting lanes only then.
        self.epoch = 0

    # --- what a lane does next --------------------------------------------------------

    def next(self, name: str, now: float) -> Call | str:
        """The call lane ``name`` makes now, ``WAIT`` (for the others, or for its call in
        flight), or ``DONE``."""
        lane = self.lanes[name]
        if lane.call is not None:
            return WAIT
        if now >= self.end and lane.pos is not Pos.DONE:
            self._to(lane, Pos.DONE, [])  # the deadline bounds everything: what is left stays in the report
            self.epoch += 1
        while True:
            if lane.pos is Pos.DONE:
                return DONE
            step = self._advance(lane, now)
            if step is None:
                return WAIT
            if isinstance(step, _Moved):
                continue  # the lane moved on: ask again
            call = self._call(lane, step, now)
            if call is None:
                continue  # gated: skipped
            lane.call, lane.since = call, now
            lane.bound = now + max(0.0, call.timeout) + GRACE_S
            if call.step is not Step.LOOK and call.step is not Step.SURVEY and call.step is not Step.STAGE:
                lane.started.add(call.step)
            if call.step in T.STOP and lane.stopped_at is None:
                lane.stopped_at = now
            return call

    def _advance(self, lane: Lane, now: float) -> Step | _Moved | None:
        """The lane's next step, after moving it between positions; None: it waits."""
        pos = lane.pos
        if pos in (Pos.SURVEY, Pos.STAGE, Pos.CLAIMING, Pos.FORWARD, Pos.TAIL, Pos.ROLLBACK, Pos.LOOK):
            if pos in _FORWARD and self.decision is Decision.ROLLBACK and lane.start is not Start.CATCH_UP:
                return self._to_rollback(lane)
            if pos in _FORWARD and lane.start is Start.CATCH_UP and lane.failure is not None:
                return self._to(lane, Pos.LOOK, [Step.LOOK])  # left as it is: the fleet went forward
            if lane.todo:
                return lane.todo.pop(0)
            return self._end_of(lane, now)
        if pos is Pos.SURVEYED:
            return self._after_survey(now) if self._all(Pos.SURVEYED) else None
        if pos is Pos.STAGED:
            return self._after_stage(now) if self._all(Pos.STAGED) else None
        if pos is Pos.CLAIMED:
            if self.decision is Decision.ROLLBACK:
                return self._to_rollback(lane)
            claiming = [x for x in self.lanes.values() if x.start is Start.FULL and x.pos is Pos.CLAIMING]
            if claiming and lane.start is Start.FULL:
                return None
            return self._to(lane, Pos.FORWARD, T.forward(lane.shape)[1:])
        if pos is Pos.BARRIER:
            if self.decision is Decision.ROLLBACK:
                return self._to_rollback(lane)
            if self.decision is Decision.COMMIT:
                return self._to(lane, Pos.TAIL, T.tail(self._shaped(lane)))
            return None
        return None

    def _end_of(self, lane: Lane, now: float) -> _Moved:
        """A position's steps are done: where the lane goes."""
        if lane.pos is Pos.SURVEY:
            return self._to(lane, Pos.SURVEYED, [])
        if lane.pos is Pos.STAGE:
            return self._to(lane, Pos.STAGED, [])
        if lane.pos is Pos.CLAIMING:
            self.epoch += 1
            return self._to(lane, Pos.CLAIMED, [])
        if lane.pos is Pos.FORWARD:
            if lane.start is Start.CATCH_UP:
                if lane.failure is not None:
                    return self._to(lane, Pos.LOOK, [Step.LOOK])  # left as it is: the fleet went forward
                return self._to(lane, Pos.TAIL, T.tail(self._shaped(lane)))
            self._to(lane, Pos.BARRIER, [])
            self._decide(now)
            return MOVED
        if lane.pos in (Pos.TAIL, Pos.ROLLBACK):
            return self._to(lane, Pos.LOOK, [Step.LOOK])
        return self._to(lane, Pos.DONE, [])

    def _to(self, lane: Lane, pos: Pos, todo: list[Step]) -> _Moved:
        lane.pos, lane.todo = pos, list(todo)
        return MOVED

    def _to_rollback(self, lane: Lane) -> _Moved:
        forward_started = lane.started & {r.step for r in T.FORWARD}
        if lane.earlier:  # what an earlier driver of this cycle may have done is undone too
            forward_started |= self._earlier_steps(lane)
        return self._to(lane, Pos.ROLLBACK, T.rollback(forward_started, lane.may_be_new))

    def _earlier_steps(self, lane: Lane) -> set[Step]:
        """The forward steps an earlier driver may have run on a lane it claimed: only the claim
        when the engine still served at the survey (the pause comes next), else every step before
        the update (the update itself: ``may_be_new``)."""
        paused = lane.surveyed is not None and lane.surveyed.paused
        if not paused and not lane.may_be_new:
            return {Step.CLAIM}
        return set(T.forward(lane.shape)) - {Step.UPDATE}

    def _all(self, pos: Pos) -> bool:
        return all(lane.pos is pos for lane in self.lanes.values())

    def _shaped(self, lane: Lane) -> T.Shape:
        keep = self.changed is False
        again = lane.start is Start.TAIL
        return T.Shape(lane.shape.sleep, lane.shape.measuring, lane.shape.clears_first, keep, again)

    # --- the barriers -----------------------------------------------------------------

    def _after_survey(self, now: float) -> _Moved:
        """Every engine answered its survey (or did not): refuse, or plan each lane's start."""
        self.epoch += 1
        failed = [lane for lane in self.lanes.values() if lane.failure is not None]
        if self.busy is not None or failed:
            if failed and not self.why:
                f = failed[0]
                self.why = f"{f.name} did not answer its survey ({f.failure.why})"  # type: ignore[union-attr]
            return self._refuse()
        self._mark_behind()
        committed = any(
            lane.record is not None and lane.record.phase is Phase.COMMITTED for lane in self.lanes.values()
        )
        if committed:
            self.decision = Decision.COMMIT
        for lane in self.lanes.values():
            r = lane.record
            if committed:
                if r is not None and r.phase is Phase.COMMITTED:
                    lane.start = Start.TAIL
                elif r is None and lane.surveyed is not None and lane.surveyed.label == self.plan.target_label:
                    lane.start = Start.CAUGHT_UP
                else:
                    lane.start = Start.CATCH_UP
                    lane.may_be_new = r is not None and r.phase is Phase.UPDATING
            else:
                lane.may_be_new = r is not None and r.phase is Phase.UPDATING
        for lane in self.lanes.values():
            needs_stage = self.plan.stage and lane.start in (Start.FULL, Start.CATCH_UP)
            self._to(lane, Pos.STAGE, [Step.STAGE] if needs_stage else [])
        return MOVED

    def _mark_behind(self) -> None:
        """An engine whose label is not the fleet's (the one it last committed, or else the one
        most engines carry) came back from a restart on its checkpoint: it is behind."""
        labels = {n: lane.old_label for n, lane in self.lanes.items()}
        fleet = self.fleet_label
        if fleet is None:
            counts = Counter(labels.values())
            top, n = counts.most_common(1)[0]
            fleet = top if n >= 2 and n * 2 > len(labels) else None
        for name, lane in self.lanes.items():
            lane.behind = fleet is not None and labels[name] != fleet

    def _after_stage(self, now: float) -> _Moved:
        self.epoch += 1
        failed = [lane for lane in self.lanes.values() if lane.failure is not None and lane.start is Start.FULL]
        if failed and self.decision is Decision.OPEN:
            f = failed[0]
            self.why = f"the new weights did not check on {f.name} ({f.failure.why})"  # type: ignore[union-attr]
            return self._refuse()
        for lane in self.lanes.values():
            lane.budget_end = min(self.forward_end, now + self.plan.budgets.get(lane.name, self.plan.deadline_s))
            if lane.start in (Start.FULL, Start.CATCH_UP):
                if lane.failure is not None:  # a catch-up lane whose checkpoint did not check
                    self._to(lane, Pos.LOOK, [Step.LOOK])
                else:
                    forward = T.forward(lane.shape)
                    assert forward[0] is Step.CLAIM, forward
                    self._to(lane, Pos.CLAIMING, forward[:1])
            elif lane.start is Start.TAIL:
                self._to(lane, Pos.TAIL, T.tail(self._shaped(lane)))
            else:
                self._to(lane, Pos.LOOK, [Step.LOOK])
        return MOVED

    def _refuse(self) -> _Moved:
        self.epoch += 1
        self.decision = Decision.REFUSE
        for lane in self.lanes.values():
            self._to(lane, Pos.DONE, [])
        return MOVED

    def _decide(self, now: float) -> None:
        """Commit once every full lane is updated; a failure decided the rollback already."""
        if self.decision is not Decision.OPEN:
            return
        full = [lane for lane in self.lanes.values() if lane.start is Start.FULL]
        if not all(lane.pos is Pos.BARRIER and lane.failure is None for lane in full):
            return
        self.decision = Decision.COMMIT
        self.epoch += 1
        if self.plan.weights_changed:
            self.changed = None
        else:
            self.changed = any(lane.before != lane.after for lane in full)

    def _fail(self, lane: Lane, step: Step, why: str, reach: Reach, now: float) -> None:
        if lane.failure is None:
            lane.failure = Failure(step, why, reach)
        if reach in (Reach.DOWN, Reach.HUNG) and lane.gone is not Reach.DOWN:
            lane.gone = reach
        if step is Step.RESET:
            lane.reset_failed = True
        if lane.pos in _FORWARD and lane.start is Start.FULL and self.decision is Decision.OPEN:
            self.decision = Decision.ROLLBACK
            self.epoch += 1
            self.why = self.why or f"{step} failed on {lane.name}: {why}"

    # --- one call ---------------------------------------------------------------------

    def _call(self, lane: Lane, step: Step, now: float) -> Call | None:
        """The call for ``step``, or None when a gate skips it."""
        back = lane.pos is Pos.ROLLBACK
        if self._gated(lane, step, back):
            return None
        timeout = self._timeout(lane, step, now)
        p = self.plan
        kw: dict[str, Any] = {}
        if step is Step.CLAIM:
            kw["label"] = self._record(lane, Phase.CLAIMED)
        elif step is Step.UPDATE:
            kw["label"] = self._record(lane, Phase.UPDATING)
        elif step is Step.COMMIT:
            kw["label"] = self._record(lane, Phase.COMMITTED)
        elif step is Step.LABEL:
            kw["label"] = (lane.old_label or "") if back else p.target_label
        elif step is Step.CLEAR_BUS:
            kw["keep_cpu"] = p.keep_cpu_first
        elif step is Step.KEEP_TIERS:
            kw["keep_cpu"] = True
        elif step is Step.RESET:
            # Requests a "keep" pause froze hold blocks of the old weights: reset with them (they are
            # recomputed), or the reset never succeeds.  A rollback keeps zkv's keys: its tiers hold KV of
            # the weights it serves again.
            kw["running"] = back or p.pause_mode == "keep"
            kw["external"] = not back
        elif step is Step.ROLLBACK_WEIGHTS:
            kw["rollback"] = True
        return Call(lane.name, step, timeout, back=back, **kw)

    def _gated(self, lane: Lane, step: Step, back: bool) -> bool:
        if step in (Step.LOOK, Step.SURVEY, Step.STAGE):
            return False
        if lane.gone is not None and step in T.ENGINE_STEPS:
            lane.skipped.add(step)
            return True  # nothing listens, or it stopped answering: its look at the end says which
        if lane.reset_failed and step in T.AFTER_RESET:
            return True  # it would serve KV of other weights: it stays paused
        if step is Step.LABEL and lane.started & T.SERVE_AGAIN and not lane.ok & T.SERVE_AGAIN:
            return True  # not serving again: the cycle's record stays, so that running it again resumes it
        if step is Step.ROLLBACK_WEIGHTS and self.plan.rollbacks.get(lane.name) is None:
            return True  # nothing loads the old weights back: its weights stay unknown
        if back and step in T.AFTER_RESET and self._serves(lane) is not Serves.OLD:
            return True  # weights nobody knows are not served
        return False

    def _timeout(self, lane: Lane, step: Step, now: float) -> float:
        p = self.plan
        if step is Step.LOOK:
            return min(p.look_s, self.end - now)
        if step is Step.SURVEY:
            return min(p.call_timeout, p.look_s, self.forward_end - now)
        if step is Step.STAGE:
            return self.forward_end - now
        if lane.pos in _FORWARD:
            return min(p.call_timeout, lane.budget_end - now)
        reserve = min(p.look_s, (self.end - now) / 4)
        bound = min(p.call_timeout, self.end - reserve - now)
        if lane.gone is not None:
            bound = min(bound, p.look_s)  # its bus too is likely gone with it: a short try
        return bound

    def _record(self, lane: Lane, phase: Phase) -> str:
        if phase is Phase.CLAIMED and lane.may_be_new:
            phase = Phase.UPDATING  # an earlier driver's update may have run: a claim never hides that
        return L.encode(
            L.CycleRecord(
                self.plan.cycle_id, phase, lane.old_label, self.plan.new_label, self.host, self.pid, self.until
            )
        )

    # --- answers ------------------------------------------------------------------------

    def done(
        self, name: str, now: float, value: Any = None, failure: tuple[str, Reach] | None = None, sent: bool = True
    ) -> None:
        """The answer to lane ``name``'s call: ``value``, or ``failure`` (why, reach);
        ``sent=False``: the call never reached the engine (nothing to undo)."""
        lane = self.lanes[name]
        call = lane.call
        if call is None:
            return  # a straggler of a lane already given up
        lane.call = None
        if not sent and call.step in T.BUS_STEPS:
            lane.started.discard(call.step)  # never reached the bus: nothing to undo
        if lane.overdue:  # recorded as failed when it was given up; an answer says it answers again
            lane.overdue = False
            if failure is None or failure[1] is Reach.ANSWERED:
                if lane.gone is Reach.HUNG:
                    lane.gone = None
            return
        why = failure[0] if failure is not None else ""
        self.records.append(StepRecord(call.step, name, failure is None, now - lane.since, why, call.back))
        if failure is None:
            lane.ok.add(call.step)
            self._took(lane, call, now, value)
            return
        if call.label is not None:
            lane.wrote = None  # the label may or may not have been written: no check against it
        if call.step is Step.LOOK:
            lane.look_reach = failure[1]
        else:
            self._fail(lane, call.step, failure[0], failure[1], now)

    def _took(self, lane: Lane, call: Call, now: float, value: Any) -> None:
        step = call.step
        if call.label is not None:
            lane.wrote = call.label
        if step is Step.SURVEY:
            self._surveyed(lane, value)
        elif step is Step.STAGE:
            lane.staged = value
        elif step is Step.CHECKSUM_BEFORE:
            lane.before = value
        elif step is Step.CHECKSUM_AFTER:
            lane.after = value
        elif step in (Step.CLEAR_BUS, Step.DROP_TIERS, Step.KEEP_TIERS):
            lane.fate = value if isinstance(value, Tiers) else (Tiers.KEPT if call.keep_cpu else Tiers.DROPPED)
        elif step in T.SERVE_AGAIN:
            lane.served_at = now
        elif step is Step.LOOK:
            lane.looked = value

    def _surveyed(self, lane: Lane, look: Look) -> None:
        lane.surveyed = look
        try:
            record = L.decode(look.label)
        except L.LabelError as err:
            self._fail(lane, Step.SURVEY, f"its label is a cycle record this zkv cannot read: {err}", Reach.ANSWERED, 0)
            return
        lane.record = record
        if record is None:
            lane.old_label = look.label
            return
        lane.old_label = record.old
        lane.earlier = record.cycle == self.plan.cycle_id
        lane.may_be_new = lane.earlier and record.phase is Phase.UPDATING
        if record.cycle != self.plan.cycle_id:
            why = (
                f"cycle {record.cycle!r} is in progress on engine {lane.name} (its weight version label says so): "
                f"finish it (run cycle {record.cycle!r} again) before starting another"
            )
            self.busy = self.busy or CycleBusyInfo(record.cycle, lane.name, why)
        elif self._alive is not None and self._alive(record):
            why = (
                f"cycle {record.cycle!r} on engine {lane.name} is driven by process {record.pid} on "
                f"{record.host} (until its deadline): a second driver is refused"
            )
            self.busy = self.busy or CycleBusyInfo(record.cycle, lane.name, why)

    # --- time -------------------------------------------------------------------------

    def next_wakeup(self) -> float:
        """When ``tick`` has something to do: a call's bound, or at the latest the deadline."""
        bounds = [lane.bound for lane in self.lanes.values() if lane.call is not None and not lane.overdue]
        return min([*bounds, self.end + GRACE_S])

    def tick(self, now: float) -> list[str]:
        """Give up calls past their bound (the engine is taken for hung; its lane goes on
        when the call returns); past the deadline, give up every lane still going.
        Returns the lanes that changed."""
        moved = []
        for lane in self.lanes.values():
            call = lane.call
            if call is not None and not lane.overdue and now >= lane.bound:
                lane.overdue = True
                if call.label is not None:
                    lane.wrote = None  # it may yet write the label
                why = f"no answer within {call.timeout + GRACE_S:.1f} s"
                self.records.append(StepRecord(call.step, lane.name, False, now - lane.since, why, call.back))
                if call.step is Step.LOOK:
                    lane.look_reach = Reach.HUNG
                else:
                    self._fail(lane, call.step, why, Reach.HUNG, now)
                if lane.pos in _WAITS_AT:  # the others need not wait for its answer
                    self._to(lane, _WAITS_AT[lane.pos], [])
                moved.append(lane.name)
                self.epoch += 1
            if now >= self.end + GRACE_S and lane.pos is not Pos.DONE:
                if lane.call is not None:
                    lane.look_reach = lane.look_reach or Reach.HUNG
                lane.call = None
                self._to(lane, Pos.DONE, [])
                moved.append(lane.name)
                self.epoch += 1
        return moved

    @property
    def finished(self) -> bool:
        return all(lane.pos is Pos.DONE for lane in self.lanes.values())

    # --- the report -------------------------------------------------------------------

    def _serves(self, lane: Lane) -> Serves:
        if lane.surveyed is None:
            return Serves.UNKNOWN  # it never told this driver anything
        if lane.wrote is not None and lane.looked is not None and lane.looked.label != lane.wrote:
            return Serves.UNKNOWN  # it lost what this driver wrote: started again, on weights it chose
        serves = self._serves_by_steps(lane)
        if serves is Serves.NEW and Reach.DOWN in (lane.gone, lane.look_reach):
            return Serves.UNKNOWN  # its process went away: started again, it loads its own checkpoint
        return serves

    def _serves_by_steps(self, lane: Lane) -> Serves:
        r = lane.record
        if r is not None and r.cycle == self.plan.cycle_id and r.phase is Phase.COMMITTED and not lane.started:
            return Serves.NEW  # an earlier driver's commit, and nothing since
        look = lane.surveyed
        if r is None and not lane.started and look is not None and look.label == self.plan.target_label:
            return Serves.NEW  # an earlier driver of this cycle finished it: the label it writes last says so
        updated = Step.UPDATE in lane.started or lane.may_be_new
        if self.decision is Decision.COMMIT:
            if lane.start in (Start.TAIL, Start.CAUGHT_UP) or Step.UPDATE in lane.ok:
                return Serves.NEW
            return Serves.UNKNOWN if updated else Serves.OLD
        if not updated:
            return Serves.OLD
        return Serves.OLD if Step.ROLLBACK_WEIGHTS in lane.ok else Serves.UNKNOWN

    def _state(self, lane: Lane) -> State:
        """What the engine answered last: its last look, or its survey in a refused cycle."""
        if self.decision is Decision.REFUSE:
            look = lane.surveyed
            failed = lane.failure if lane.failure is not None and lane.failure.step is Step.SURVEY else None
            reach = failed.reach if failed is not None else None
        else:
            look, reach = lane.looked, lane.look_reach
        if look is not None:
            return State.PAUSED if look.paused else State.SERVING
        return {Reach.DOWN: State.DOWN, Reach.ANSWERED: State.ERROR}.get(reach, State.HUNG)  # type: ignore[arg-type]

    def _tiers(self, lane: Lane) -> Tiers:
        if lane.fate is not None:
            return lane.fate
        if lane.earlier and Step.CLEAR_BUS in self._earlier_steps(lane) and self.decision is not Decision.COMMIT:
            return Tiers.UNKNOWN  # an earlier driver may have cleared its bus
        bus_started = lane.started & T.BUS_STEPS
        if not bus_started:
            return Tiers.UNTOUCHED
        if bus_started & {Step.CLEAR_BUS, Step.DROP_TIERS, Step.KEEP_TIERS}:
            return Tiers.UNKNOWN
        if Step.RESUME_BUS in lane.ok:
            return Tiers.INTACT
        return Tiers.UNKNOWN

    def report(self, now: float) -> CycleReport:
        p = self.plan
        report = CycleReport(p.cycle_id, weights_changed=self.changed, pause_mode=p.pause_mode)
        report.steps = list(self.records)
        report.seconds = now - self.t0
        report.why = self.why
        for lane in self.lanes.values():
            e = EngineReport(lane.name)
            e.serves = self._serves(lane)
            e.state = self._state(lane)
            stopped = lane.stopped_at is not None
            e.paused = e.state is State.PAUSED or (
                e.state in (State.HUNG, State.ERROR) and stopped and lane.served_at is None
            )
            if lane.failure is not None:
                e.failed_step, e.why = lane.failure.step, lane.failure.why
            look = lane.looked or lane.surveyed
            e.label = look.label if look is not None else None
            e.tiers = self._tiers(lane)
            e.in_flight = InFlight.of(p.pause_mode) if stopped else None
            if lane.before is not None and lane.after is not None:
                e.weights_changed = lane.before != lane.after
            if lane.stopped_at is not None:
                e.paused_s = (lane.served_at if lane.served_at is not None else now) - lane.stopped_at
            e.staged = lane.staged.digest if lane.staged is not None else None
            e.behind = lane.behind or lane.start is Start.CATCH_UP
            report.engines[lane.name] = e
        report.checksum_s = max(
            (r.seconds for r in self.records if r.step in (Step.CHECKSUM_BEFORE, Step.CHECKSUM_AFTER)), default=0.0
        )
        after = {lane.after for lane in self.lanes.values()}
        report.weights_after = after.pop() if len(after) == 1 else None
        report.committed = self.decision is Decision.COMMIT
        report.outcome = self._outcome(report)
        answers = [e.state for e in report.engines.values()]
        left = report.outcome is Outcome.INCOMPLETE or any(s is not State.SERVING for s in answers)
        if left and report.outcome is not Outcome.REFUSED:
            report.finish, report.finish_argv = self.finish
        return report

    def _outcome(self, report: CycleReport) -> Outcome:
        if self.decision is Decision.REFUSE:
            return Outcome.REFUSED
        engines = report.engines.values()
        serving = all(e.state is State.SERVING for e in engines)
        clean = all(lane.failure is None and not lane.skipped for lane in self.lanes.values())
        if self.decision is Decision.COMMIT:
            done = serving and clean and all(e.serves is Serves.NEW for e in engines)
            return Outcome.COMMITTED if done else Outcome.INCOMPLETE
        back = [s for s in self.records if s.back and not s.ok]
        skipped = any(lane.skipped for lane in self.lanes.values())
        done = serving and not back and not skipped and all(e.serves is Serves.OLD for e in engines)
        return Outcome.ROLLED_BACK if done else Outcome.INCOMPLETE
