"""The thin driver of a cycle: one thread per engine (kept for the fleet's
life: a thread start costs more than a call on a loaded machine) runs its
lane's calls as the core (``core.py``) hands them out, each bounded by the
timeout the core gives; this thread wakes at the core's deadlines to give up
calls that outlive their bound.  Nothing here decides anything.

``ACTIONS`` is the other half of the step table: what each step asks of the
engine (``engine.py``), forward or back."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable

from .core import DONE, WAIT, Call, CycleBusyInfo, CycleCore, alive_here
from .engine import Engine, StepFailed
from .plan import CyclePlan
from .report import CycleReport
from .terms import Reach, Step

_RESET_FIRST_WAIT_S = 0.005  # vLLM says nothing when held blocks go: retries start soon and back off
_RESET_MAX_WAIT_S = 0.2


class CycleBusy(Exception):
    """Another cycle (``other``), or another driver of this one, holds ``engine``;
    nothing was touched."""

    def __init__(self, info: CycleBusyInfo):
        super().__init__(info.why)
        self.other, self.engine, self.reason = info.other, info.engine, info.why


def _reset(engine: Engine, call: Call, plan: CyclePlan) -> None:
    """vLLM refuses a reset while blocks are held (running requests, transfers in flight):
    try again, backing off from 5 ms to 0.2 s apart, for at most ``reset_tries_s``."""
    tries_s = min(plan.reset_tries_s, call.timeout)
    end = time.monotonic() + tries_s
    wait = _RESET_FIRST_WAIT_S
    while True:
        if engine.reset(call.running, call.external, max(0.05, end - time.monotonic())):
            return
        if time.monotonic() + wait > end:
            raise StepFailed(f"/reset_prefix_cache: still success: false after {tries_s:.1f} s")
        time.sleep(wait)
        wait = min(_RESET_MAX_WAIT_S, wait * 2)


def _update(engine: Engine, call: Call, plan: CyclePlan) -> None:
    t0 = time.monotonic()
    if call.label is not None:
        engine.set_label(call.label, call.timeout)
    source = (plan.rollbacks if call.rollback else plan.sources)[engine.name]
    assert source is not None
    source.apply(engine, max(0.0, call.timeout - (time.monotonic() - t0)))


def _label(engine: Engine, call: Call, plan: CyclePlan) -> None:
    assert call.label is not None
    engine.set_label(call.label, call.timeout)


ACTIONS: dict[Step, Callable[[Engine, Call, CyclePlan], Any]] = {
    Step.SURVEY: lambda e, c, p: e.look(p.sleep, c.timeout),
    Step.LOOK: lambda e, c, p: e.look(p.sleep, c.timeout),
    Step.STAGE: lambda e, c, p: p.sources[e.name].stage(e, c.timeout),
    Step.CLAIM: _label,
    Step.PAUSE: lambda e, c, p: e.stop(p.pause_mode, False, c.timeout),
    Step.SLEEP: lambda e, c, p: e.stop(p.pause_mode, True, c.timeout),
    Step.PAUSE_BUS: lambda e, c, p: e.pause_bus(c.timeout),
    Step.CLEAR_BUS: lambda e, c, p: e.clear_bus(c.keep_cpu, c.timeout),
    Step.CHECKSUM_BEFORE: lambda e, c, p: e.weights(c.timeout),
    Step.UPDATE: _update,
    Step.CHECKSUM_AFTER: lambda e, c, p: e.weights(c.timeout),
    Step.COMMIT: _label,
    Step.DROP_TIERS: lambda e, c, p: e.clear_bus(False, c.timeout, p.target_label),
    Step.KEEP_TIERS: lambda e, c, p: e.clear_bus(True, c.timeout),
    Step.RESUME_BUS: lambda e, c, p: e.resume_bus(c.timeout),
    Step.RESET: _reset,
    Step.RESUME: lambda e, c, p: e.start(False, c.timeout),
    Step.WAKE_UP: lambda e, c, p: e.start(True, c.timeout),
    Step.LABEL: _label,
    Step.ROLLBACK_WEIGHTS: _update,
}
assert set(ACTIONS) == set(Step), set(Step) - set(ACTIONS)


def invoke(engine: Engine, call: Call, plan: CyclePlan) -> tuple[Any, tuple[str, Reach] | None, bool]:
    """(value, failure, sent) of one call; an exception of the caller's own update is its failure."""
    if call.timeout <= 0:
        return None, ("no time left before the engine's budget or the cycle's deadline", Reach.ANSWERED), False
    try:
        return ACTIONS[call.step](engine, call, plan), None, True
    except StepFailed as err:
        return None, (err.why, err.reach), err.sent
    except Exception as err:  # noqa: BLE001 - an update hook's failure is this engine's, named in the report
        return None, (f"{type(err).__name__}: {err}", Reach.ANSWERED), True


class Workers:
    """One thread per engine, started on first use and kept until ``close``; an engine
    whose thread is still caught in a call an earlier cycle gave up gets a new one."""

    def __init__(self) -> None:
        self._queues: dict[str, queue.SimpleQueue[Callable[[], None] | None]] = {}
        self._busy: dict[str, threading.Event] = {}

    def submit(self, name: str, job: Callable[[], None]) -> None:
        q, busy = self._queues.get(name), self._busy.get(name)
        if q is None or busy is None or busy.is_set():
            if q is not None:
                q.put(None)  # the stuck thread ends once its call returns
            q, busy = queue.SimpleQueue(), threading.Event()
            self._queues[name], self._busy[name] = q, busy
            threading.Thread(target=self._serve, args=(q, busy), name=f"zkv-cycle-{name}", daemon=True).start()
        busy.set()
        q.put(job)

    @staticmethod
    def _serve(q: queue.SimpleQueue[Callable[[], None] | None], busy: threading.Event) -> None:
        while (job := q.get()) is not None:
            try:
                job()
            finally:
                busy.clear()

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        self._queues.clear()
        self._busy.clear()


_running: set[str] = set()
_running_lock = threading.Lock()


def run(
    plan: CyclePlan,
    engines: dict[str, Engine],
    workers: Workers,
    *,
    clock: Callable[[], float] = time.monotonic,
    alive: Callable[[Any], bool] = alive_here,
    finish: tuple[str, list[str] | None] | None = None,
    fleet_label: str | None = None,
) -> CycleReport:
    """Run (or finish) ``plan`` over ``engines``; the report says where each engine is.
    Raises ``CycleBusy`` (nothing touched) when another cycle, or another driver of this
    one, holds the fleet."""
    with _running_lock:
        if plan.cycle_id in _running:
            why = f"cycle {plan.cycle_id!r} is already being driven in this process: a second driver is refused"
            raise CycleBusy(CycleBusyInfo(plan.cycle_id, next(iter(engines)), why))
        _running.add(plan.cycle_id)
    try:
        return _run(plan, engines, workers, clock, alive, finish, fleet_label)
    finally:
        with _running_lock:
            _running.discard(plan.cycle_id)


def _run(
    plan: CyclePlan,
    engines: dict[str, Engine],
    workers: Workers,
    clock: Callable[[], float],
    alive: Callable[[Any], bool],
    finish: tuple[str, list[str] | None] | None,
    fleet_label: str | None,
) -> CycleReport:
    clears = {n: bool(e.clears_before_update) for n, e in engines.items()}
    core = CycleCore(
        plan, clears, clock(), time.time(), pid=os.getpid(), alive=alive, finish=finish, fleet_label=fleet_label
    )
    cond = threading.Condition()

    def lane(name: str) -> None:
        engine = engines[name]
        while True:
            with cond:
                while True:
                    seen = core.epoch
                    call = core.next(name, clock())
                    if core.epoch != seen:
                        cond.notify_all()  # this lane moved the others past a barrier, or decided
                    if call != WAIT:
                        break
                    cond.wait_for(lambda seen=seen: core.epoch != seen)  # type: ignore[misc]
                if call == DONE:
                    cond.notify_all()  # the runner waits for the last lane
                    return
            assert isinstance(call, Call)
            value, failure, sent = invoke(engine, call, plan)
            with cond:
                seen = core.epoch
                core.done(name, clock(), value, failure, sent)
                if core.epoch != seen:
                    cond.notify_all()

    for name in engines:
        workers.submit(name, lambda name=name: lane(name))  # type: ignore[misc]
    with cond:
        while not core.finished:
            cond.wait(max(0.0, core.next_wakeup() - clock()))
            if core.tick(clock()):
                cond.notify_all()
        report = core.report(clock())
    if core.busy is not None:
        raise CycleBusy(core.busy)
    return report
