"""The replay checker: a pure function from a parsed trace and what the
driver saw (:class:`Observation`) to a :class:`Report`.  No sockets, no clock:
tests build observations by hand.  See ``zkv.replay`` for the rules.
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any

from ..obs.stats import percentiles
from ..trace import CONTROL_REQUESTS, Trace
from ..wire.vocab import ControlOp, Outcome

Key = tuple  # (client label, task label) as in the trace
COUNTERS = ("copies_after_ack",)  # rank stats that must not move


# --- what the driver saw -------------------------------------------------------------------


@dataclass
class Observed:
    outcome: str
    reason: str
    latency_ms: float


@dataclass
class ControlResult:
    line: int
    op: str
    client: str
    result: str  # "ok", "noop", or the error code (e.g. "not_paused", "no_reply")
    reason: str
    wall_ms: float
    fields: dict[str, Any] = field(default_factory=dict)  # the bus's reply: epoch, gen, drain_ms ...
    expect: tuple[str, ...] | None = None


@dataclass
class Observation:
    """Everything the checker needs; the driver fills it, tests can build it."""

    outcomes: dict[Key, list[Observed]] = field(default_factory=lambda: collections.defaultdict(list))
    submitted: set[Key] = field(default_factory=set)
    anomalies: list[tuple[Key, str]] = field(default_factory=list)  # the bus reported a task twice
    controls: list[ControlResult] = field(default_factory=list)
    ranks_before: list[dict] | None = None  # status()["ranks"]
    ranks_after: list[dict] | None = None
    stats_fresh: bool = True
    duration_s: float = 0.0
    late_messages: int = 0  # results after a client-side timeout / cancel: allowed, counted
    notes: list[str] = field(default_factory=list)
    target: str = ""


# --- the checker (sans-IO) -------------------------------------------------------------------


@dataclass
class Report:
    ok: bool
    violations: list[dict[str, Any]]
    tasks: int
    outcomes: dict[str, int]
    latency_ms: dict[str, float]
    latency_all_ms: dict[str, float]
    throughput_tasks_per_s: float
    duration_s: float
    controls: dict[str, dict[str, Any]]
    control_results: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    notes: list[str]
    source: str = ""
    target: str = ""
    late_messages: int = 0
    teardown: str = ""  # an embedded cluster's stop: what it met (ranks it killed), '' for a clean one

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def rank_stats_fresh(status: dict) -> bool:
    """True when every live rank's last reported stats cover every task the
    broker dispatched to it (stats travel in heartbeats, so they lag)."""
    if status.get("inflight"):
        return False
    for r in status.get("ranks", []):
        if not r.get("alive"):
            continue
        s = r.get("stats") or {}
        if not s or s.get("tasks_ok", 0) + s.get("tasks_failed", 0) < r.get("dispatched", 0):
            return False
    return True


def _rank_deltas(before: list[dict] | None, after: list[dict] | None) -> list[dict[str, Any]]:
    base = {r["rank"]: r for r in before or []}
    out = []
    for r in after or []:
        b = base.get(r["rank"])
        same_proc = b is not None and b.get("pid") == r.get("pid")
        row: dict[str, Any] = {"rank": r["rank"], "alive": r.get("alive", False), "pid": r.get("pid")}
        for name in COUNTERS:
            now = (r.get("stats") or {}).get(name, 0)
            then = (b.get("stats") or {}).get(name, 0) if b is not None and same_proc else 0
            row[name] = now - then
        out.append(row)
    return out


class _Violations(list):
    """The violations found so far, each with the trace lines it names."""

    def add(self, kind: str, lines: list[int], message: str, **extra: Any) -> None:
        self.append({"kind": kind, "lines": sorted({ln for ln in lines if ln}), "message": message, **extra})


def check(trace: Trace, obs: Observation) -> Report:
    """The invariants and expectations, as a pure function of what was seen."""
    violations = _Violations()
    specs = sorted(trace.tasks.values(), key=lambda s: s.index)
    counts, lat_all, lat_ok = _check_outcomes(specs, obs, violations)
    _check_fifo(trace, obs, violations)
    labels = {spec.key: spec for spec in specs}
    for key, message in obs.anomalies:
        named = labels.get(key)
        violations.add(
            "reported_twice",
            [named.line] if named else [],
            f"task {named.label if named else key} (line {named.line if named else '?'}): {message}",
            task=named.label if named else str(key),
        )
    for cr in obs.controls:
        if cr.expect is not None and cr.result not in cr.expect:
            because = f" ({cr.reason})" if cr.reason else ""
            violations.add(
                "unexpected_control",
                [cr.line],
                f"{cr.op} by {cr.client} (line {cr.line}): {cr.result}{because}, expected {' or '.join(cr.expect)}",
            )
    ranks = _rank_deltas(obs.ranks_before, obs.ranks_after)
    _check_paused_ranks(trace, obs, ranks, violations)
    done = sum(counts.values())
    return Report(
        ok=not violations,
        violations=list(violations),
        tasks=len(specs),
        outcomes=dict(sorted(counts.items())),
        latency_ms=percentiles(lat_ok),
        latency_all_ms=percentiles(lat_all),
        throughput_tasks_per_s=round(done / obs.duration_s, 1) if obs.duration_s > 0 else 0.0,
        duration_s=round(obs.duration_s, 4),
        controls=_control_figures(obs),
        control_results=[
            {
                "line": cr.line,
                "op": cr.op,
                "client": cr.client,
                "result": cr.result,
                "reason": cr.reason,
                "wall_ms": round(cr.wall_ms, 3),
                **cr.fields,
            }
            for cr in obs.controls
        ],
        ranks=ranks,
        notes=list(obs.notes),
        source=trace.source,
        target=obs.target,
        late_messages=obs.late_messages,
    )


def _check_outcomes(
    specs: list, obs: Observation, violations: _Violations
) -> tuple[collections.Counter[str], list[float], list[float]]:
    """Every replayed task got exactly one outcome, one its expectations allow."""
    counts: collections.Counter[str] = collections.Counter()
    lat_all: list[float] = []
    lat_ok: list[float] = []
    for spec in specs:
        seen = obs.outcomes.get(spec.key, [])
        what = f"task {spec.label} ({spec.summary}, line {spec.line})"
        if spec.key not in obs.submitted:
            violations.add(
                "not_replayed", [spec.line], f"{what} was never submitted (the replay stopped early)", task=spec.label
            )
            continue
        if not seen:
            violations.add("no_outcome", [spec.line], f"{what} got no outcome", task=spec.label)
            continue
        if len(seen) > 1:
            violations.add(
                "duplicate_outcome",
                [spec.line],
                f"{what} got {len(seen)} outcomes: {', '.join(o.outcome for o in seen)}",
                task=spec.label,
            )
        first = seen[0]
        counts[first.outcome] += 1
        lat_all.append(first.latency_ms)
        if first.outcome == Outcome.OK:
            lat_ok.append(first.latency_ms)
        for line, allowed in spec.expects:
            if first.outcome not in allowed:
                because = f" ({first.reason})" if first.reason else ""
                at = "" if line == spec.line else f" by line {line}"
                violations.add(
                    "unexpected_outcome",
                    [spec.line, line],
                    f"{what}: outcome {first.outcome}{because}, expected {' or '.join(allowed)}{at}",
                    task=spec.label,
                )
    return counts, lat_all, lat_ok


def _check_fifo(trace: Trace, obs: Observation, violations: _Violations) -> None:
    """The broker's queue is FIFO and a clear cancels what is still in it, so
    among one client's tasks between two clears, none may have run after one
    that was cancelled."""
    segment = 0
    first_cancel: dict[tuple[int, str], Any] = {}
    for op in trace.ops:
        if op.ev == ControlOp.CLEAR:
            segment += 1
        elif op.ev == "submit" and obs.outcomes.get(op.key):
            spec, outcome = trace.tasks[op.key], obs.outcomes[op.key][0].outcome
            cancelled = first_cancel.get((segment, op.client))
            if outcome == Outcome.CANCELLED and cancelled is None:
                first_cancel[(segment, op.client)] = spec
            elif outcome in (Outcome.OK, Outcome.FAILED) and cancelled is not None:
                violations.add(
                    "fifo",
                    [cancelled.line, spec.line],
                    f"task {spec.label} (line {spec.line}) ran ({outcome}) although task {cancelled.label} "
                    f"(line {cancelled.line}), submitted before it by the same client, was cancelled: "
                    "a clear cancels a suffix of the FIFO queue",
                    task=spec.label,
                )


def _check_paused_ranks(trace: Trace, obs: Observation, ranks: list[dict[str, Any]], violations: _Violations) -> None:
    """No rank's work counters moved while the bus was paused."""
    pause_lines = [op.line for op in trace.ops if op.ev in (ControlOp.PAUSE, ControlOp.CLEAR)]
    for row in ranks:
        moved = {name: row[name] for name in COUNTERS if row[name] > 0}
        if moved:
            violations.add(
                "copy_while_paused",
                pause_lines,
                f"rank {row['rank']} ran work while paused: " + ", ".join(f"{k} +{v}" for k, v in moved.items()),
                rank=row["rank"],
            )
    if pause_lines and (obs.ranks_after is None or not obs.stats_fresh):
        violations.add(
            "unverified",
            [],
            "could not read fresh rank stats after the replay, so 'no copy while paused' is unchecked"
            + ("" if obs.ranks_after is not None else " (no status)"),
        )


def _control_figures(obs: Observation) -> dict[str, dict[str, Any]]:
    """Per control op: its results, wall time and the bus's own time for it."""
    per_op: dict[str, dict[str, Any]] = {}
    for kind in CONTROL_REQUESTS:
        rows = [cr for cr in obs.controls if cr.op == kind]
        if not rows:
            continue
        bus_field = {ControlOp.PAUSE: "drain_ms", ControlOp.CLEAR: "clear_ms", ControlOp.RESUME: "resume_ms"}[kind]
        per_op[kind] = {
            "results": dict(collections.Counter(cr.result for cr in rows)),
            "wall_ms": percentiles([cr.wall_ms for cr in rows if cr.result == Outcome.OK]),
            bus_field: percentiles([float(cr.fields[bus_field]) for cr in rows if bus_field in cr.fields]),
        }
    return per_op


def format_report(report: Report, max_violations: int = 40) -> str:
    """The human summary ``zkv replay`` prints."""

    def pct(d: dict[str, float]) -> str:
        return "none" if not d.get("n") else f"p50 {d['p50']} ms, p99 {d['p99']} ms, max {d['max']} ms (n={d['n']})"

    lines = [
        f"replayed {report.source} against {report.target}: {report.tasks} tasks, "
        f"{len(report.control_results)} control ops in {report.duration_s:.3f} s "
        f"({report.throughput_tasks_per_s} tasks/s)"
    ]
    lines.append("outcomes: " + (", ".join(f"{k} {v}" for k, v in report.outcomes.items()) or "none"))
    lines.append(f"latency (ok tasks): {pct(report.latency_ms)}")
    for op, d in report.controls.items():
        res = ", ".join(f"{k} {v}" for k, v in d["results"].items())
        bus = next(
            (f"; bus {k} {pct(v)}" for k, v in d.items() if k.endswith("_ms") and k != "wall_ms" and v.get("n")), ""
        )
        lines.append(f"{op}: {res}; wall {pct(d['wall_ms'])}{bus}")
    if report.ranks:
        lines.append(
            "ranks: "
            + "; ".join(f"rank {r['rank']} " + ", ".join(f"{k} {r[k]}" for k in COUNTERS) for r in report.ranks)
        )
    for note in report.notes:
        lines.append(f"note: {note}")
    if report.ok:
        lines.append("OK: every task got exactly one outcome, every expectation held, no copy ran while paused")
    else:
        lines.append(f"VIOLATIONS ({len(report.violations)}):")
        for v in report.violations[:max_violations]:
            where = f"line {', '.join(map(str, v['lines']))}: " if v["lines"] else ""
            lines.append(f"  {where}[{v['kind']}] {v['message']}")
        if len(report.violations) > max_violations:
            kinds = collections.Counter(v["kind"] for v in report.violations[max_violations:])
            lines.append(
                f"  ... and {len(report.violations) - max_violations} more ("
                + ", ".join(f"{k} {n}" for k, n in kinds.items())
                + "); --json lists them all"
            )
    return "\n".join(lines)
