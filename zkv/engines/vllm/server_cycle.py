"""One RL cycle over a fleet of vLLM servers, each with its own zkv bus, as
one transaction (docs/engine-vllm.md, "A fleet of vLLM servers").

    fleet = ServerFleet([ServerSpec("a", "http://10.0.0.1:8000", "tcp://10.0.0.1:5555"), ...])
    report = fleet.cycle("step-42", ReloadWeights("/ckpt/step-42"), rollback=ReloadWeights("/ckpt/step-41"))

The steps, each on every engine at once: claim (the cycle's label on every
engine) → pause (or sleep) every engine → pause every bus (acked only when
no copy is in flight) → clear every bus keeping its CPU tier → the weight
update → resume every bus (and, unless the weights were measured unchanged,
pause / clear without the keep / resume: the CPU generation moves, so
nothing computed under the old weights is served) → reset every engine's
prefix cache (retried while vLLM answers ``success: false``) → resume (or
wake) every engine → the new version label.

All or nothing: a step that fails on any engine before the update is
committed everywhere rolls every engine back (the previous weights loaded
again where the update may have run, the buses resumed with their CPU tiers
intact, the engines resumed, the old label).  One deadline bounds the whole
cycle, rollback included (``rollback_s`` of it is kept for the rollback).

Resumable: the cycle's state lives on the engines, not in the trainer: each
engine's weight version label (vLLM's ``/update_weight_version``) says
``zkv-cycle:<id>:<phase>:<old label>`` while a cycle runs, and every step
is idempotent (a bus already paused or cleared answers noop, a paused engine
pauses again, ``reload_weights`` of the same path loads the same weights).
Running the same cycle again (same id) after the trainer died finishes it
or rolls it back; a cycle with another id on a fleet where one is in
progress is refused (``CycleBusy``) before anything is touched.

The report (``CycleReport``) names each engine, what it serves now (the new
weights, the old, or unknown), whether it is left paused, each step's time
and the step where it failed, why, and the command that finishes the cycle
when it could not be finished.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ...fleet.fleet import Fleet
from ...fleet.report import FleetError
from ...wire.errors import ZkvError
from .server import ServerError, VllmServer

LABEL = "zkv-cycle"
_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
OUTCOMES = ("committed", "rolled_back", "refused", "incomplete")  # refused: an engine did not answer, nothing touched


class CycleBusy(ZkvError):
    """Another cycle is in progress on this fleet (its id is on an engine's label)."""

    def __init__(self, other: str, engine: str):
        super().__init__(
            "cycle_busy",
            f"cycle {other!r} is in progress on engine {engine} (its weight version label says so): finish it "
            f"(run cycle {other!r} again) before starting another",
        )
        self.other, self.engine = other, engine


class WeightUpdate(Protocol):
    """What loads weights into one engine; called once per engine, within ``timeout``."""

    def __call__(self, server: VllmServer, timeout: float) -> None: ...


@dataclass(frozen=True)
class ReloadWeights:
    """vLLM's ``reload_weights`` from a checkpoint directory on the server's host."""

    path: str

    def __call__(self, server: VllmServer, timeout: float) -> None:
        server.reload_weights(self.path, timeout=timeout)

    def __str__(self) -> str:
        return f"reload_weights {self.path}"


@dataclass(frozen=True)
class ServerSpec:
    """One engine: its ``name``, its server's ``url`` and its zkv bus's frontend ``bus``."""

    name: str
    url: str
    bus: str


def label(cycle_id: str, phase: str, old: str) -> str:
    return f"{LABEL}:{cycle_id}:{phase}:{old}"


def parse_label(text: str | None) -> tuple[str, str, str] | None:
    """(cycle id, phase, old label) of a cycle's label, or None for any other label."""
    if not text or not text.startswith(LABEL + ":"):
        return None
    parts = text.split(":", 3)
    if len(parts) != 4:
        return None
    return parts[1], parts[2], parts[3]


@dataclass
class Step:
    """One step on one engine: ``ok``, how long it took and, if not, why."""

    step: str
    engine: str
    ok: bool
    seconds: float
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "engine": self.engine, "ok": self.ok, "ms": round(self.seconds * 1000, 1)} | (
            {"why": self.why} if self.why else {}
        )


@dataclass
class EngineReport:
    name: str
    serves: str = "old"  # "new", "old" or "unknown": the weights it serves (or would, once reachable)
    paused: bool = False  # left paused or asleep (the report's ``finish`` says how to end it)
    state: str = "serving"  # "serving", "down" (nothing listens) or "hung" (it stopped answering)
    failed_step: str = ""
    why: str = ""
    label: str | None = None


@dataclass
class CycleReport:
    cycle_id: str
    outcome: str = "incomplete"
    weights_changed: bool | None = None  # measured (None: taken as changed, not measured)
    engines: dict[str, EngineReport] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    seconds: float = 0.0
    finish: str = ""  # the command that finishes an incomplete cycle

    def failed(self) -> list[Step]:
        return [s for s in self.steps if not s.ok]

    def step_seconds(self) -> dict[str, float]:
        """The longest engine's time per step, in order."""
        out: dict[str, float] = {}
        for s in self.steps:
            out[s.step] = max(out.get(s.step, 0.0), s.seconds)
        return out

    def describe(self) -> str:
        lines = [f"cycle {self.cycle_id}: {self.outcome} in {self.seconds:.2f} s"]
        for e in self.engines.values():
            state = f"serves the {e.serves} weights" if e.serves != "unknown" else "serves unknown weights"
            if e.state != "serving":
                state = f"{e.state.upper()} ({state} once it answers)"
            tail = f"; failed at {e.failed_step}: {e.why}" if e.failed_step else ""
            lines.append(f"  {e.name}: {state}{', LEFT PAUSED' if e.paused else ''}{tail}")
        for name in self.step_seconds():
            each = ", ".join(
                f"{s.engine} {s.seconds * 1000:.0f} ms{'' if s.ok else ' FAILED'}" for s in self.steps if s.step == name
            )
            lines.append(f"  step {name}: {each}")
        if self.finish:
            lines.append(f"  to finish it: {self.finish}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "cycle": self.cycle_id,
            "outcome": self.outcome,
            "weights_changed": self.weights_changed,
            "seconds": round(self.seconds, 3),
            "engines": {
                n: {
                    "serves": e.serves,
                    "paused": e.paused,
                    "state": e.state,
                    "failed_step": e.failed_step,
                    "why": e.why,
                }
                for n, e in self.engines.items()
            },
            "steps": [s.to_json() for s in self.steps],
            "finish": self.finish,
        }


def reset_prefix_cache(server: VllmServer, tries_s: float, call_timeout: float = 30.0, running: bool = False) -> None:
    """vLLM refuses a reset while blocks are held (running requests, transfers in flight):
    try again, every 50 ms up to 0.5 s apart, for at most ``tries_s``; then ``ServerError``.
    A poll: vLLM says nothing when the blocks are let go."""
    end = time.monotonic() + tries_s
    wait = 0.05
    while True:
        left = end - time.monotonic()
        if server.reset_prefix_cache(running, timeout=max(0.1, min(call_timeout, left))):
            return
        if time.monotonic() + wait > end:
            raise ServerError(server.url, "/reset_prefix_cache", f"still success: false after {tries_s:.1f} s")
        time.sleep(wait)
        wait = min(0.5, wait * 2)


class _Failed(Exception):
    """A step failed on at least one engine (the steps recorded say where and why)."""


class ServerFleet:
    """vLLM servers, each with its own bus, driven through RL cycles (see the module docstring).

    ``call_timeout`` bounds each HTTP call; ``reset_tries_s`` how long a prefix
    cache reset is retried while vLLM answers ``success: false``."""

    def __init__(
        self,
        servers: list[ServerSpec],
        *,
        call_timeout: float = 30.0,
        reset_tries_s: float = 10.0,
        finish_hint: str = "",
    ):
        names = [s.name for s in servers]
        if not servers or len(set(names)) != len(names):
            raise ValueError(f"a server fleet needs engines with distinct names, got {names}")
        self.specs = list(servers)
        self.servers = {s.name: VllmServer(s.url, call_timeout) for s in servers}
        self.call_timeout = call_timeout
        self.reset_tries_s = reset_tries_s
        self.finish_hint = finish_hint
        self._pool = ThreadPoolExecutor(max_workers=max(4, len(servers)), thread_name_prefix="zkv-server-fleet")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ServerFleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the cycle -----------------------------------------------------------------------

    def cycle(
        self,
        cycle_id: str,
        update: WeightUpdate,
        *,
        rollback: WeightUpdate | None = None,
        weights_changed: bool = True,
        pause_mode: str = "wait",
        sleep: bool = False,
        deadline_s: float = 120.0,
        rollback_s: float | None = None,
        new_label: str | None = None,
    ) -> CycleReport:
        """Run (or finish) cycle ``cycle_id``; ``update`` loads the new weights into one engine,
        ``rollback`` the previous ones (without it, a failure after an update ran leaves that
        engine's weights unknown).  ``weights_changed=False`` is checked: vLLM's checksums are
        measured before and after, and the tiers are kept only if nothing changed."""
        if not _ID.match(cycle_id):
            raise ValueError(f"a cycle id is 1-64 of [A-Za-z0-9._-], got {cycle_id!r}")
        t0 = time.monotonic()
        end = t0 + deadline_s
        back_s = min(rollback_s if rollback_s is not None else max(5.0, deadline_s / 3), deadline_s / 2)
        forward_end = end - back_s
        report = CycleReport(cycle_id, engines={s.name: EngineReport(s.name) for s in self.specs})
        run = _Run(self, report, forward_end)

        olds = run.survey(cycle_id)  # raises CycleBusy before anything is touched
        if olds is None:
            return run.finish(t0, "refused")
        new = new_label or f"{LABEL}-done:{cycle_id}"
        bus = Fleet([{"name": s.name, "broker": s.bus} for s in self.specs], timeout=max(1.0, deadline_s / 4))
        updated: set[str] = set()
        try:
            try:
                run.each("claim", lambda n, s, t: s.set_weight_version(label(cycle_id, "paused", olds[n]), t))
                if sleep:
                    run.each("sleep", lambda n, s, t: s.sleep(0, pause_mode, t))
                else:
                    run.each("pause", lambda n, s, t: s.pause(pause_mode, t))
                run.buses("pause_buses", lambda t: bus.pause(timeout=t))
                run.buses("clear_buses", lambda t: bus.clear(keep_cpu=True, timeout=t))
                before = (
                    run.collect("checksum_before", lambda n, s, t: s.weight_checksums(t))
                    if not weights_changed
                    else None
                )

                def apply(n: str, s: VllmServer, t: float) -> None:
                    s.set_weight_version(label(cycle_id, "updating", olds[n]), t)
                    updated.add(n)  # from here its weights may be the new ones
                    update(s, t)
                    s.set_weight_version(label(cycle_id, "updated", olds[n]), t)

                run.each("update", apply)
                if before is not None:
                    after = run.collect("checksum_after", lambda n, s, t: s.weight_checksums(t))
                    report.weights_changed = any(before[n] != after[n] for n in before)
            except _Failed:
                run.end = end
                self._roll_back(run, bus, updated, rollback, olds, sleep)
                return run.finish(t0, "rolled_back")
            # Committed: every engine holds the new weights.  From here a failure is finished
            # forward (running the cycle again), never rolled back.
            for e in report.engines.values():
                e.serves = "new"
            run.end = end
            run.strict = False
            changed = report.weights_changed is not False
            run.buses("resume_buses", lambda t: bus.resume(timeout=t))
            if changed:  # the CPU generation moves: nothing of the old weights is served
                run.buses("pause_buses_again", lambda t: bus.pause(timeout=t))
                run.buses("drop_tiers", lambda t: bus.clear(keep_cpu=False, timeout=t))
                run.buses("resume_buses_again", lambda t: bus.resume(timeout=t))
            # Requests a "keep" pause froze hold blocks of the old weights: reset with them
            # (they are recomputed on the new weights), or the reset never succeeds.
            running = pause_mode == "keep"
            run.each("reset_prefix_cache", lambda n, s, t: self._reset(s, t, running))
            # An engine whose cache could not be reset would serve KV of the old weights: it stays paused.
            reset = {x.engine for x in report.steps if x.step == "reset_prefix_cache" and x.ok}
            if sleep:
                run.each("wake_up", lambda n, s, t: s.wake_up(None, t), only=reset)
            else:
                run.each("resume", lambda n, s, t: s.resume(t), only=reset)
            run.each("label", lambda n, s, t: s.set_weight_version(new, t), only=reset)
            return run.finish(t0, "committed" if not report.failed() else "incomplete")
        finally:
            bus.close()

    def _roll_back(
        self,
        run: "_Run",
        bus: Fleet,
        updated: set[str],
        rollback: WeightUpdate | None,
        olds: dict[str, str],
        sleep: bool,
    ) -> None:
        """Every engine back on the old weights, its bus resumed with its CPU tier intact
        (the only clear kept it), resumed, labelled as before.  Best effort within the deadline;
        whatever cannot be done is in the report."""
        run.strict = False
        if updated:
            if rollback is None:
                for n in updated:
                    run.report.engines[n].serves = "unknown"
                    run.note(n, "rollback", "the update may have run and no rollback was given")
            else:
                run.each("rollback_weights", lambda n, s, t: rollback(s, t), only=updated)
            for n in updated:
                if n in run.gone or any(
                    s.step == "rollback_weights" and s.engine == n and not s.ok for s in run.report.steps
                ):
                    run.report.engines[n].serves = "unknown"  # its update may have run, its rollback did not
        run.buses("resume_buses", lambda t: bus.resume(timeout=t))
        run.each("reset_prefix_cache", lambda n, s, t: self._reset(s, t, running=True))
        if sleep:
            run.each("wake_up", lambda n, s, t: s.wake_up(None, t))
        else:
            run.each("resume", lambda n, s, t: s.resume(t))
        ok_weights = [n for n, e in run.report.engines.items() if e.serves == "old"]
        run.each("label", lambda n, s, t: s.set_weight_version(olds[n], t), only=set(ok_weights))

    def _reset(self, server: VllmServer, timeout: float, running: bool = False) -> None:
        reset_prefix_cache(server, min(timeout, self.reset_tries_s), self.call_timeout, running)

    def finish_command(self, cycle_id: str) -> str:
        return self.finish_hint.format(cycle=cycle_id) if self.finish_hint else f"run cycle {cycle_id!r} again"

    def states(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Each engine's label, pause state and reachability, as it reports them now."""
        out: dict[str, dict[str, Any]] = {}
        for name, s in self.servers.items():
            try:
                out[name] = {"label": s.weight_version(timeout), "paused": s.is_paused(timeout)}
            except ServerError as err:
                out[name] = {"error": err.why, "down": err.down, "hung": err.hung}
        return out


class _Run:
    """One cycle's steps as they run: fan-out, timing, the report."""

    def __init__(self, fleet: ServerFleet, report: CycleReport, end: float):
        self.fleet, self.report, self.end = fleet, report, end
        self.strict = True  # a failed step stops the forward path (raises _Failed)
        self.gone: dict[str, str] = {}  # engines "down" or "hung": later steps skip them

    def left(self) -> float:
        return self.end - time.monotonic()

    def note(self, engine: str, step: str, why: str) -> None:
        e = self.report.engines[engine]
        if not e.failed_step:
            e.failed_step, e.why = step, why

    def survey(self, cycle_id: str) -> dict[str, str] | None:
        """Each engine's old label (None: an engine did not answer, so nothing is touched);
        another cycle in progress raises ``CycleBusy``."""
        labels = self.collect("survey", lambda n, s, t: s.weight_version(t), strict=False)
        olds: dict[str, str] = {}
        for name, text in labels.items():
            parsed = parse_label(text)
            if parsed is not None and parsed[0] != cycle_id:
                raise CycleBusy(parsed[0], name)
            olds[name] = parsed[2] if parsed is not None else (text or "")
        known = [o for o in olds.values() if o]
        for spec in self.fleet.specs:  # an engine that restarted lost its label: the fleet's is its
            olds.setdefault(spec.name, known[0] if known else "")
        if self.report.failed():
            return None
        return olds

    def collect(
        self, step: str, fn: Callable[[str, VllmServer, float], Any], strict: bool | None = None
    ) -> dict[str, Any]:
        results: dict[str, Any] = {}
        self._fan(step, fn, None, results)
        if (self.strict if strict is None else strict) and any(not s.ok for s in self.report.steps if s.step == step):
            raise _Failed(step)
        return results

    def each(self, step: str, fn: Callable[[str, VllmServer, float], Any], only: set[str] | None = None) -> None:
        self._fan(step, fn, only, {})
        if self.strict and any(not s.ok for s in self.report.steps if s.step == step):
            raise _Failed(step)

    def _fan(self, step: str, fn: Callable, only: set[str] | None, results: dict[str, Any]) -> None:
        names = [n for n in self.fleet.servers if (only is None or n in only) and n not in self.gone]
        t = max(0.0, min(self.fleet.call_timeout, self.left()))

        def one(name: str) -> Step:
            t0 = time.monotonic()
            try:
                results[name] = fn(name, self.fleet.servers[name], t)
                return Step(step, name, True, time.monotonic() - t0)
            except ServerError as err:
                if err.down or err.hung:
                    self.gone[name] = "down" if err.down else "hung"
                return Step(step, name, False, time.monotonic() - t0, err.why)
            except Exception as err:  # the caller's update hook: any failure is this engine's
                return Step(step, name, False, time.monotonic() - t0, f"{type(err).__name__}: {err}")

        for done in self._pool_map(one, names):
            self.report.steps.append(done)
            if not done.ok:
                self.note(done.engine, step, done.why)

    def _pool_map(self, fn: Callable[[str], Step], names: list[str]) -> list[Step]:
        futures = [self.fleet._pool.submit(fn, n) for n in names]
        return [f.result() for f in futures]  # each call is bounded by its own timeout

    def buses(self, step: str, op: Callable[[float], Any]) -> None:
        """A fleet operation on every bus (all or nothing across buses, fleet.py)."""
        t0 = time.monotonic()
        left = min(self.left(), 2 * self.fleet.call_timeout)  # a bus that never answers costs this much
        try:
            if left <= 0:
                raise ZkvError("deadline", "no time left before the cycle's deadline")
            op(left)
        except FleetError as err:
            for b in err.report.failed():
                self.report.steps.append(Step(step, b.name, False, time.monotonic() - t0, b.describe(step)))
                self.note(b.name, step, b.describe(step))
            if self.strict:
                raise _Failed(step) from None
            return
        except ZkvError as err:
            for name in self.fleet.servers:
                self.report.steps.append(Step(step, name, False, time.monotonic() - t0, str(err)))
                self.note(name, step, str(err))
            if self.strict:
                raise _Failed(step) from None
            return
        for name in self.fleet.servers:
            self.report.steps.append(Step(step, name, True, time.monotonic() - t0))

    def finish(self, t0: float, outcome: str) -> CycleReport:
        """The report: each engine's state from the steps it answered, the outcome, the finish command."""
        r = self.report
        r.seconds = time.monotonic() - t0
        asked = {s.engine for s in r.steps if s.step in ("pause", "sleep")}
        resumed = {s.engine for s in r.steps if s.ok and s.step in ("resume", "wake_up")}
        for name, e in r.engines.items():
            e.state = self.gone.get(name, "serving")
            e.paused = name in asked and name not in resumed and e.state != "down"
        unfinished = any(e.paused or e.serves == "unknown" for e in r.engines.values())
        if outcome == "committed" and r.failed():
            outcome = "incomplete"
        if outcome in ("committed", "rolled_back") and unfinished:
            outcome = "incomplete"
        r.outcome = outcome
        if outcome == "incomplete" or any(e.state != "serving" for e in r.engines.values()):
            r.finish = self.fleet.finish_command(r.cycle_id)
        return r
