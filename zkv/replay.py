"""Replay a trace against a bus and check what happened.

Two halves.  The checker (:func:`check`) is a pure function from a parsed
:class:`~zkv.trace.Trace` and an :class:`Observation` to a :class:`Report`:
no sockets, no clock, testable with hand-made observations.  The driver
(:class:`Replayer`) is the thin part: it plays the trace's operations through
:class:`~zkv.client.Client` objects (one per trace client) at the recorded
timing or as fast as it can, files every outcome, and collects the ranks'
stats before and after.  Every wait in it is bounded.

Ordering.  The broker's ROUTER fair-queues between clients, so a pause sent
by one client could overtake submits another client sent just before it.
Before each pause / clear / resume the driver therefore pings every client
that submitted since the last control request (a ping is answered after every
earlier message of that client), and a control request returns before the
next record is played.  That makes a trace's expectations deterministic:
tasks submitted before a pause run, tasks submitted while paused are held,
then run after resume or are cancelled by a clear, and tasks submitted while
cleared are rejected.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import zmq

from .security import Curve
from .client import Client, ZkvError
from .layout import CacheLayout
from .results import ResultBook
from .trace import LAYOUT_ENV, Op, Trace

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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentiles(values: list[float]) -> dict[str, float]:
    """n, p50, p99 and max (nearest rank), rounded to microseconds."""
    if not values:
        return {"n": 0}
    v = sorted(values)

    def at(p: float) -> float:
        return round(v[max(0, math.ceil(p / 100 * len(v)) - 1)], 3)

    return {"n": len(v), "p50": at(50), "p99": at(99), "max": round(v[-1], 3)}


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
            then = (b.get("stats") or {}).get(name, 0) if same_proc else 0
            row[name] = now - then
        out.append(row)
    return out


def check(trace: Trace, obs: Observation) -> Report:
    """The invariants and expectations, as a pure function of what was seen."""
    violations: list[dict[str, Any]] = []

    def violate(kind: str, lines: list[int], message: str, **extra: Any) -> None:
        violations.append({"kind": kind, "lines": sorted(set(ln for ln in lines if ln)), "message": message, **extra})

    counts: collections.Counter[str] = collections.Counter()
    lat_all: list[float] = []
    lat_ok: list[float] = []
    specs = sorted(trace.tasks.values(), key=lambda s: s.index)
    for spec in specs:
        seen = obs.outcomes.get(spec.key, [])
        what = f"task {spec.label} ({spec.summary}, line {spec.line})"
        if spec.key not in obs.submitted:
            violate("not_replayed", [spec.line], f"{what} was never submitted (the replay stopped early)", task=spec.label)
            continue
        if not seen:
            violate("no_outcome", [spec.line], f"{what} got no outcome", task=spec.label)
            continue
        if len(seen) > 1:
            violate("duplicate_outcome", [spec.line], f"{what} got {len(seen)} outcomes: {', '.join(o.outcome for o in seen)}", task=spec.label)
        first = seen[0]
        counts[first.outcome] += 1
        lat_all.append(first.latency_ms)
        if first.outcome == "ok":
            lat_ok.append(first.latency_ms)
        for line, allowed in spec.expects:
            if first.outcome not in allowed:
                because = f" ({first.reason})" if first.reason else ""
                at = "" if line == spec.line else f" by line {line}"
                violate("unexpected_outcome", [spec.line, line],
                        f"{what}: outcome {first.outcome}{because}, expected {' or '.join(allowed)}{at}", task=spec.label)
    # The broker's queue is FIFO and a clear cancels what is still in it, so
    # among one client's tasks between two clears, none may have run after
    # one that was cancelled.
    segment = 0
    first_cancel: dict[tuple[int, str], Any] = {}
    for op in trace.ops:
        if op.ev == "clear":
            segment += 1
        elif op.ev == "submit" and obs.outcomes.get(op.key):
            spec, outcome = trace.tasks[op.key], obs.outcomes[op.key][0].outcome
            first = first_cancel.get((segment, op.client))
            if outcome == "cancelled" and first is None:
                first_cancel[(segment, op.client)] = spec
            elif outcome in ("ok", "failed") and first is not None:
                violate("fifo", [first.line, spec.line],
                        f"task {spec.label} (line {spec.line}) ran ({outcome}) although task {first.label} (line {first.line}), "
                        "submitted before it by the same client, was cancelled: a clear cancels a suffix of the FIFO queue", task=spec.label)
    labels = {spec.key: spec for spec in specs}
    for key, message in obs.anomalies:
        spec = labels.get(key)
        violate("reported_twice", [spec.line] if spec else [],
                f"task {spec.label if spec else key} (line {spec.line if spec else '?'}): {message}", task=spec.label if spec else str(key))
    for cr in obs.controls:
        if cr.expect is not None and cr.result not in cr.expect:
            because = f" ({cr.reason})" if cr.reason else ""
            violate("unexpected_control", [cr.line], f"{cr.op} by {cr.client} (line {cr.line}): {cr.result}{because}, expected {' or '.join(cr.expect)}")
    ranks = _rank_deltas(obs.ranks_before, obs.ranks_after)
    pause_lines = [op.line for op in trace.ops if op.ev in ("pause", "clear")]
    for row in ranks:
        moved = {name: row[name] for name in COUNTERS if row[name] > 0}
        if moved:
            violate("copy_while_paused", pause_lines,
                    f"rank {row['rank']} ran work while paused: " + ", ".join(f"{k} +{v}" for k, v in moved.items()), rank=row["rank"])
    if pause_lines and (obs.ranks_after is None or not obs.stats_fresh):
        violate("unverified", [], "could not read fresh rank stats after the replay, so 'no copy while paused' is unchecked"
                + ("" if obs.ranks_after is not None else " (no status)"))
    per_op: dict[str, dict[str, Any]] = {}
    for op in ("pause", "clear", "resume"):
        rows = [cr for cr in obs.controls if cr.op == op]
        if not rows:
            continue
        bus_field = {"pause": "drain_ms", "clear": "clear_ms", "resume": "resume_ms"}[op]
        per_op[op] = {
            "results": dict(collections.Counter(cr.result for cr in rows)),
            "wall_ms": percentiles([cr.wall_ms for cr in rows if cr.result == "ok"]),
            bus_field: percentiles([float(cr.fields[bus_field]) for cr in rows if bus_field in cr.fields]),
        }
    done = sum(counts.values())
    return Report(
        ok=not violations,
        violations=violations,
        tasks=len(specs),
        outcomes=dict(sorted(counts.items())),
        latency_ms=percentiles(lat_ok),
        latency_all_ms=percentiles(lat_all),
        throughput_tasks_per_s=round(done / obs.duration_s, 1) if obs.duration_s > 0 else 0.0,
        duration_s=round(obs.duration_s, 4),
        controls=per_op,
        control_results=[{"line": cr.line, "op": cr.op, "client": cr.client, "result": cr.result, "reason": cr.reason,
                          "wall_ms": round(cr.wall_ms, 3), **cr.fields} for cr in obs.controls],
        ranks=ranks,
        notes=list(obs.notes),
        source=trace.source,
        target=obs.target,
        late_messages=obs.late_messages,
    )


def format_report(report: Report, max_violations: int = 40) -> str:
    """The human summary ``zkv replay`` prints."""
    def pct(d: dict[str, float]) -> str:
        return "none" if not d.get("n") else f"p50 {d['p50']} ms, p99 {d['p99']} ms, max {d['max']} ms (n={d['n']})"

    lines = [f"replayed {report.source} against {report.target}: {report.tasks} tasks, "
             f"{len(report.control_results)} control ops in {report.duration_s:.3f} s ({report.throughput_tasks_per_s} tasks/s)"]
    lines.append("outcomes: " + (", ".join(f"{k} {v}" for k, v in report.outcomes.items()) or "none"))
    lines.append(f"latency (ok tasks): {pct(report.latency_ms)}")
    for op, d in report.controls.items():
        res = ", ".join(f"{k} {v}" for k, v in d["results"].items())
        bus = next((f"; bus {k} {pct(v)}" for k, v in d.items() if k.endswith("_ms") and k != "wall_ms" and v.get("n")), "")
        lines.append(f"{op}: {res}; wall {pct(d['wall_ms'])}{bus}")
    if report.ranks:
        lines.append("ranks: " + "; ".join(f"rank {r['rank']} " + ", ".join(f"{k} {r[k]}" for k in COUNTERS) for r in report.ranks))
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
            lines.append(f"  ... and {len(report.violations) - max_violations} more ("
                         + ", ".join(f"{k} {n}" for k, n in kinds.items()) + "); --json lists them all")
    return "\n".join(lines)


# --- the driver ------------------------------------------------------------------------------


class ObservingBook(ResultBook):
    """A ResultBook that also notices the bus reporting a task twice.

    Allowed: anything after the client itself ended a task (timeout, or the
    cancel that follows a clear), and a surviving rank's result after the
    broker failed a task because another rank died.  Not allowed: a result
    from a rank that already answered, a broker outcome after the task ended,
    or a rank result for a task the broker called cancelled or rejected.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ended: dict[int, str] = {}  # task -> "ranks", "bus:<outcome>" or "client"
        self.anomalies: list[tuple[int, str]] = []

    def on_result(self, msg: dict, now: float):  # type: ignore[override]
        task, rank = msg["task"], msg["rank"]
        entry = self.open.get(task)
        if entry is not None:
            if msg["gen"] >= self.gen and entry.fold is not None and rank not in entry.fold.waiting:
                self.anomalies.append((task, f"rank {rank} reported it twice"))
        else:
            how = self.ended.get(task, "")
            if how == "ranks":
                self.anomalies.append((task, f"rank {rank} reported it after every rank had answered"))
            elif how in ("bus:cancelled", "bus:rejected"):
                self.anomalies.append((task, f"rank {rank} ran it ({msg['outcome']}) although the broker said {how[4:]}"))
        out = super().on_result(msg, now)
        if out is not None:
            self.ended[task] = "ranks"
        return out

    def on_outcome(self, task: int, outcome: str, reason: str, now: float, gen: int | None = None):  # type: ignore[override]
        if task not in self.open and self.ended.get(task, "client") != "client":
            self.anomalies.append((task, f"the broker reported {outcome} after the task had ended ({self.ended[task]})"))
        out = super().on_outcome(task, outcome, reason, now, gen)
        if out is not None:
            self.ended[task] = f"bus:{outcome}"
        return out

    def expire(self, now: float):  # type: ignore[override]
        done = super().expire(now)
        for out in done:
            self.ended[out.task] = "client"
        return done

    def cancel_all(self, reason: str, now: float):  # type: ignore[override]
        done = super().cancel_all(reason, now)
        for out in done:
            self.ended[out.task] = "client"
        return done


class Replayer:
    """Play a trace through real clients; see the module docstring for ordering."""

    def __init__(self, trace: Trace, address: str, *, speed: float | None = 1.0, task_timeout: float = 30.0,
                 op_timeout: float = 30.0, stats_wait: float = 3.0, ctx: zmq.Context | None = None,
                 progress: Callable[[int], None] | None = None, curve: Curve | None = None):
        if speed is not None and speed <= 0:
            raise ValueError("speed must be positive (or None for as fast as possible)")
        self.trace = trace
        self.address = address
        self.speed = speed
        self.task_timeout = task_timeout
        self.op_timeout = op_timeout
        self.stats_wait = stats_wait
        self.ctx = ctx or zmq.Context.instance()
        self.progress = progress
        self.curve = curve
        self.clients: dict[str, Client] = {}
        self.owner: dict[Any, str] = {}  # socket -> client label
        self.poller = zmq.Poller()
        self.keys: dict[tuple[str, int], Key] = {}  # (client label, client task id) -> trace key
        self.dirty: set[str] = set()  # clients that submitted since the last control request
        self.obs = Observation(target=address)

    # -- sockets --

    def _client(self, label: str) -> Client:
        c = self.clients.get(label)
        if c is None:
            c = Client(self.address, ctx=self.ctx, request_timeout=self.op_timeout, curve=self.curve)
            c.book = ObservingBook()
            self.clients[label] = c
            for sock in (c.dealer, c.pull):
                self.poller.register(sock, zmq.POLLIN)
                self.owner[sock] = label
        return c

    def _collect(self, label: str) -> None:
        for out in self.clients[label].poll(0):
            key = self.keys.get((label, out.task))
            if key is not None:
                self.obs.outcomes[key].append(Observed(out.outcome, out.reason, round(out.elapsed_s * 1000, 3)))

    def _next_due(self, now: float) -> float:
        due = [d for d in (c.book.next_deadline() for c in self.clients.values()) if d is not None]
        return max(0.0, min(due) - now) if due else math.inf

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for traffic to any client, and file outcomes."""
        events = dict(self.poller.poll(max(0.0, timeout) * 1000)) if self.clients else {}
        now = time.monotonic()
        ready = {self.owner[s] for s in events}
        for label, c in self.clients.items():
            if label in ready or c.finished or ((d := c.book.next_deadline()) is not None and d <= now):
                self._collect(label)

    def _wait_until(self, target: float) -> None:
        while (left := target - time.monotonic()) > 0:
            self._pump(min(left, self._next_due(time.monotonic())))

    # -- operations --

    def _submit(self, op: Op) -> None:
        c = self._client(op.client)
        task = c.submit_raw(op.body, self.task_timeout)
        self.keys[(op.client, task)] = op.key
        self.obs.submitted.add(op.key)
        self.dirty.add(op.client)
        self._pump(0)

    def _control(self, op: Op) -> None:
        c = self._client(op.client)
        for label in sorted(self.dirty - {op.client}):
            try:
                self.clients[label].ping(timeout=self.op_timeout)
            except ZkvError as err:
                self.obs.notes.append(f"line {op.line}: ordering barrier ping from client {label} failed: {err.reason}")
        self.dirty.clear()
        timeout = op.params.get("timeout_ms", int(self.op_timeout * 1000)) / 1000
        fields: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            if op.ev == "pause":
                reply = c.pause(timeout)
            elif op.ev == "clear":
                reply = c.clear(keep_cpu=op.params.get("keep_cpu", False), timeout=timeout)
            else:
                reply = c.resume(op.params.get("layout"), timeout)
            result = "noop" if reply.get("noop") else "ok"
            reason = reply.get("note", "")
            fields = {k: reply[k] for k in ("state", "epoch", "gen", "drain_ms", "clear_ms", "resume_ms", "cancelled", "freed") if k in reply}
            for other in self.clients.values():  # one application: every client learns the generation
                if other is not c and "gen" in reply:
                    other.adopt_gen(reply["gen"], f"client {op.client} ran {op.ev}")
        except ZkvError as err:
            result, reason = err.code, err.reason
        wall_ms = (time.perf_counter() - start) * 1000
        self.obs.controls.append(ControlResult(op.line, op.ev, op.client, result, reason, round(wall_ms, 3), fields, op.expect))
        for label in self.clients:
            self._collect(label)

    def _status(self, probe: Client, wait: float) -> tuple[dict | None, bool]:
        """The broker status, waiting (bounded) for rank stats that are current."""
        deadline = time.monotonic() + wait
        st: dict | None = None
        while True:
            try:
                st = probe.status(timeout=min(self.op_timeout, max(1.0, wait)))
            except ZkvError as err:
                self.obs.notes.append(f"status failed: {err.reason}" if st is not None else err.reason)
                return st, False
            if rank_stats_fresh(st):
                return st, True
            left = deadline - time.monotonic()
            if left <= 0:
                return st, False
            # A bounded wait for the next rank heartbeat.  (Not probe.poll():
            # Client.poll can hand zmq a negative timeout, which waits forever.)
            probe.poller.poll(max(1, int(min(0.05, left) * 1000)))

    def run(self) -> Observation:
        obs = self.obs
        with Client(self.address, ctx=self.ctx, request_timeout=self.op_timeout, curve=self.curve) as probe:
            st, _ = self._status(probe, self.stats_wait)
            if st is None:
                raise ZkvError("no_reply", obs.notes.pop() if obs.notes else f"no status reply from {self.address}")
            obs.ranks_before = st["ranks"]
            if st["world"] != self.trace.world:
                obs.notes.append(f"the trace was made for world {self.trace.world}; the bus has world {st['world']}")
            if self.trace.layout is not None and st.get("layout") and st["layout"] != self.trace.layout.to_wire():
                obs.notes.append(f"the trace's layout differs from the bus's layout {st['layout']}")
            if st["state"] != "running":
                obs.notes.append(f"the bus was {st['state']} when the replay started")
            start = time.monotonic()
            try:
                ops = self.trace.ops
                t_first = ops[0].t if ops else 0.0
                for op in ops:
                    if self.speed is not None:
                        self._wait_until(start + (op.t - t_first) / self.speed)
                    if op.ev == "submit":
                        self._submit(op)
                    else:
                        self._control(op)
                    if self.progress is not None:
                        self.progress(1)
                guard = time.monotonic() + self.task_timeout + self.op_timeout
                while any(c.book.open for c in self.clients.values()) and (now := time.monotonic()) < guard:
                    self._pump(min(guard - now, self._next_due(now)))
                for label in self.clients:
                    self._collect(label)
                obs.duration_s = time.monotonic() - start
                for label, c in self.clients.items():
                    book = c.book
                    assert isinstance(book, ObservingBook)
                    for task, message in book.anomalies:
                        obs.anomalies.append((self.keys.get((label, task), (label, f"#{task}")), message))
                    obs.late_messages += sum(book.counters[k] for k in ("late_results", "late_outcomes", "stale_results"))
            finally:
                for c in self.clients.values():
                    c.close()
            st, obs.stats_fresh = self._status(probe, self.stats_wait)
            obs.ranks_after = st["ranks"] if st else None
        return obs


def parse_speed(text: str | float | None) -> float | None:
    """``max`` (as fast as possible) -> None; ``1``, ``2.5``, ``0.5x`` -> the factor."""
    if text is None:
        return 1.0
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        t = text.strip().lower()
        if t in ("max", "inf", "0"):
            return None
        try:
            value = float(t[:-1] if t.endswith("x") else t)
        except ValueError:
            raise ValueError(f"speed must be 'max' or a positive factor like 1, 2.5 or 10x, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"speed must be 'max' or a positive factor, got {text!r}")
    return value


def replay(trace: Trace, address: str, **kwargs: Any) -> Report:
    """Replay against a running broker and check."""
    return check(trace, Replayer(trace, address, **kwargs).run())


def replay_embedded(trace: Trace, *, record: str | None = None, heartbeat_ms: int = 100,
                    start_timeout: float = 120.0, **kwargs: Any) -> Report:
    """Start a LocalCluster with the trace's world size and layout, replay, stop it.

    ``record`` passes ``--record`` to its broker (the layout goes into the
    recording's header through ``ZKV_TRACE_LAYOUT``: the broker does not know it).
    """
    from .cluster import LocalCluster

    layout = trace.layout or CacheLayout()
    args = ["--heartbeat-ms", str(heartbeat_ms)]
    if record:
        args += ["--record", record]
    cluster = LocalCluster(trace.world, layout, quiet=True, broker_args=args)
    old = os.environ.get(LAYOUT_ENV)
    os.environ[LAYOUT_ENV] = json.dumps(layout.to_wire())
    try:
        try:
            cluster.start(timeout=start_timeout)
        finally:
            if old is None:
                os.environ.pop(LAYOUT_ENV, None)
            else:
                os.environ[LAYOUT_ENV] = old
        obs = Replayer(trace, cluster.endpoints.frontend, **kwargs).run()
        obs.target = f"an embedded cluster ({trace.world} ranks, {layout.gpu_blocks} GPU / {layout.cpu_blocks} CPU blocks)"
    finally:
        codes = cluster.stop()
    if any(codes.values()):
        obs.notes.append(f"cluster processes exited with {codes}")
    return check(trace, obs)
