"""What a cycle tells its caller (docs/engine-vllm.md, "The report"): per
engine, which weights it serves, what it answered last, its tiers, what
became of its requests in flight, how long it served nothing, and where and
why it failed; for the cycle, the outcome, every step's time on every engine,
the pause window and the command that finishes it.  ``to_json`` is the
schema ``zkv cycle --json`` prints (``SCHEMA`` names its version);
``describe`` is a steps × engines table for people."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from .table import ROLLBACK_ORDER
from .terms import InFlight, Outcome, PauseMode, Serves, State, Step, Tiers

SCHEMA = 1
#: Engines shown one column each; a larger fleet is shown as fastest / median / slowest.
MAX_COLUMNS = 8


@dataclass(frozen=True)
class StepRecord:
    """One step on one engine: ``ok``, how long it took, and why not; ``back``: a rollback step."""

    step: Step
    engine: str
    ok: bool
    seconds: float
    why: str = ""
    back: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": str(self.step), "engine": self.engine, "ok": self.ok}
        out["ms"] = round(self.seconds * 1000, 1)
        if self.why:
            out["why"] = self.why
        if self.back:
            out["rollback"] = True
        return out


@dataclass
class EngineReport:
    name: str
    serves: Serves = Serves.OLD
    state: State = State.SERVING  # what it answered at the end (``/health``, ``/is_paused``)
    paused: bool = False  # left paused or asleep (the report's ``finish`` says how to end it)
    failed_step: Step | None = None
    why: str = ""
    label: str | None = None  # its label at the end, as it said it
    tiers: Tiers = Tiers.UNTOUCHED
    in_flight: InFlight | None = None  # None: it was never paused
    weights_changed: bool | None = None  # measured (None: not measured)
    paused_s: float | None = None  # how long it served nothing (None: it was never paused)
    staged: str | None = None  # the digest of the checkpoint it was given, checked before any pause
    behind: bool = False  # it came into the cycle behind the fleet's weights (restarted on old ones)

    def to_json(self) -> dict[str, Any]:
        return {
            "serves": str(self.serves),
            "paused": self.paused,
            "state": str(self.state),
            "failed_step": str(self.failed_step) if self.failed_step else "",
            "why": self.why,
            "label": self.label,
            "tiers": str(self.tiers),
            "in_flight": str(self.in_flight) if self.in_flight else None,
            "weights_changed": self.weights_changed,
            "paused_ms": None if self.paused_s is None else round(self.paused_s * 1000, 1),
            "staged": self.staged,
            "behind": self.behind,
        }


@dataclass
class CycleReport:
    cycle_id: str
    outcome: Outcome = Outcome.INCOMPLETE
    weights_changed: bool | None = None  # measured over the fleet (None: taken as changed, not measured)
    pause_mode: PauseMode = PauseMode.WAIT
    engines: dict[str, EngineReport] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    seconds: float = 0.0
    checksum_s: float = 0.0  # the longest engine's time measuring its weights
    finish: str = ""  # the command that finishes the cycle, when something is left
    finish_argv: list[str] | None = None  # the same as a command line, when the cycle was started as one
    why: str = ""  # why the cycle was refused or rolled back, in one line
    weights_after: str | None = None  # the weights every engine measured after its update (when measured, equal)
    committed: bool = False  # the fleet committed (every engine updated), whatever was left after

    @property
    def kept(self) -> bool:
        """Every engine's tiers survived the cycle (the weights were measured unchanged)."""
        return bool(self.engines) and all(e.tiers is Tiers.KEPT for e in self.engines.values())

    @property
    def pause_window_s(self) -> float:
        """The longest any engine served nothing."""
        return max((e.paused_s or 0.0 for e in self.engines.values()), default=0.0)

    def failed(self) -> list[StepRecord]:
        return [s for s in self.steps if not s.ok]

    def step_seconds(self) -> dict[str, float]:
        """The longest engine's time per step, in order."""
        out: dict[str, float] = {}
        for s in self.steps:
            key = f"{s.step}{' (rollback)' if s.back else ''}"
            out[key] = max(out.get(key, 0.0), s.seconds)
        return out

    # --- for people ------------------------------------------------------------------

    def headline(self) -> str:
        n = len(self.engines)
        head = f"cycle {self.cycle_id}: {self.outcome} in {self.seconds:.2f} s"
        if self.outcome is Outcome.COMMITTED:
            head += f": every engine serves the new weights ({self._tiers_said()})"
        elif self.outcome is Outcome.ROLLED_BACK:
            head += f": every engine serves the weights it had before again ({self._tiers_said()})"
        elif self.outcome is Outcome.REFUSED:
            head += ": nothing was touched"
        if self.why:
            head += f"; {self.why}"
        if self.pause_window_s:
            head += f"; pause window {self.pause_window_s * 1000:.0f} ms over {n} engine{'s' * (n != 1)}"
        return head

    def _tiers_said(self) -> str:
        fates = sorted({str(e.tiers) for e in self.engines.values()})
        return "tiers " + "/".join(fates)

    def describe(self) -> str:
        lines = [self.headline()]
        lines += _table(self)
        for e in self.engines.values():
            if e.failed_step:
                lines.append(f"  {e.name} failed at {e.failed_step}: {e.why}")
        if self.finish and self.outcome is not Outcome.REFUSED:
            lines.append(f"  to finish it: {self.finish}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "zkv_cycle_report": SCHEMA,
            "cycle": self.cycle_id,
            "outcome": str(self.outcome),
            "why": self.why,
            "weights_changed": self.weights_changed,
            "pause_mode": str(self.pause_mode),
            "seconds": round(self.seconds, 3),
            "pause_window_ms": round(self.pause_window_s * 1000, 1),
            "checksum_ms": round(self.checksum_s * 1000, 1),
            "engines": {n: e.to_json() for n, e in self.engines.items()},
            "steps": [s.to_json() for s in self.steps],
            "committed": self.committed,
            "finish": self.finish,
            "finish_argv": self.finish_argv,
        }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return out


def _cell(records: list[StepRecord]) -> str:
    if not records:
        return "-"
    total = sum(r.seconds for r in records)
    return _ms(total) + ("" if all(r.ok for r in records) else " FAILED")


def _table(report: CycleReport) -> list[str]:
    """Steps × engines (one column each, or fastest / median / slowest for a large fleet),
    then what each engine serves, answers, kept and how long it served nothing."""
    names = list(report.engines)
    order = sorted({(s.step, s.back) for s in report.steps}, key=_row_order)
    by: dict[tuple[Step, bool, str], list[StepRecord]] = {}
    for s in report.steps:
        by.setdefault((s.step, s.back, s.engine), []).append(s)
    label = {k: f"{k[0]}{' (rollback)' if k[1] else ''}" for k in order}
    if len(names) <= MAX_COLUMNS:
        rows = [[label[k], *(_cell(by.get((k[0], k[1], n), [])) for n in names)] for k in order]
        facts = [
            ["serves", *(str(report.engines[n].serves) for n in names)],
            ["answers", *(_answers(report.engines[n]) for n in names)],
            ["tiers", *(str(report.engines[n].tiers) for n in names)],
            ["in flight", *(str(report.engines[n].in_flight or "-") for n in names)],
            ["served nothing", *(_paused(report.engines[n]) for n in names)],
        ]
        return _grid(["step", *names], rows + facts)
    rows = []
    for k in order:
        cells = [(sum(r.seconds for r in by[(k[0], k[1], n)]), n) for n in names if (k[0], k[1], n) in by]
        times = sorted(t for t, _ in cells)
        slow_t, slow_n = max(cells)
        failed = sum(1 for n in names if any(not r.ok for r in by.get((k[0], k[1], n), [])))
        rows.append(
            [label[k], str(len(cells)), _ms(times[0]), _ms(statistics.median(times)), f"{_ms(slow_t)} ({slow_n})"]
            + [str(failed) if failed else "-"]
        )

    def count(values: list[str]) -> str:
        return ", ".join(f"{v} {values.count(v)}" for v in sorted(set(values)))

    engines = list(report.engines.values())
    facts = [
        ["serves", count([str(e.serves) for e in engines])],
        ["answers", count([_answers(e) for e in engines])],
        ["tiers", count([str(e.tiers) for e in engines])],
    ]
    return _grid(["step", "engines", "fastest", "median", "slowest", "failed"], rows) + _grid(["", ""], facts)[1:]


#: Rows in the order a cycle runs them: survey, stage, forward, after the commit, rollback, the last look.
_ROWS = [
    Step.SURVEY, Step.STAGE, Step.CLAIM, Step.PAUSE, Step.SLEEP, Step.PAUSE_BUS, Step.CLEAR_BUS,
    Step.CHECKSUM_BEFORE, Step.UPDATE, Step.CHECKSUM_AFTER, Step.COMMIT, Step.DROP_TIERS, Step.KEEP_TIERS,
    Step.RESUME_BUS, Step.RESET, Step.RESUME, Step.WAKE_UP, Step.LABEL,
]  # fmt: skip


def _row_order(key: tuple[Step, bool]) -> tuple[int, int]:
    step, back = key
    if step is Step.LOOK:
        return (2, 0)
    return (1, ROLLBACK_ORDER.index(step)) if back else (0, _ROWS.index(step))


def _answers(e: EngineReport) -> str:
    return str(e.state) if e.state is not State.SERVING else "serving"


def _paused(e: EngineReport) -> str:
    if e.paused_s is None:
        return "-"
    return _ms(e.paused_s) + (" (still paused)" if e.paused else "")
