"""Parse and validate a trace (:func:`parse_trace`, :func:`load_trace`), and
check a recording's own books (:func:`check_recording`)."""

from __future__ import annotations

import base64
import collections
import json
import sys
from typing import Any, Iterable, TextIO

from ..wire import protocol as P
from ..wire.ids import decode_ids
from ..wire.layout import CacheLayout
from ..wire.vocab import ControlOp
from .format import (
    _CONTROL_KEYS,
    _OUTCOME_KEYS,
    _SUBMIT_KEYS,
    CONTROL_REQUESTS,
    DEFAULT_CONTROL_CLIENT,
    DEFAULT_TASK_CLIENT,
    EVENTS,
    FORMAT_VERSION,
    Header,
    Op,
    TaskSpec,
    Trace,
    TraceError,
)


def _expect_list(value: Any, allowed: Iterable[str] | None, line: int, source: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
        raise TraceError(line, f"expect must be a string or a non-empty list of strings, got {value!r}", source)
    if allowed is not None:
        allowed = tuple(allowed)
        for x in items:
            if x not in allowed:
                raise TraceError(line, f"expect: unknown outcome {x!r}; expected one of {', '.join(allowed)}", source)
    return tuple(items)


def _number(rec: dict, name: str, line: int, source: str) -> float | None:
    v = rec.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v < 0:
        raise TraceError(line, f"{name} must be a non-negative number of seconds, got {v!r}", source)
    return float(v)


def _header(rec: dict, line: int, source: str) -> Header:
    version = rec.get("zkv_trace")
    if version != FORMAT_VERSION:
        raise TraceError(
            line, f"unsupported trace format version {version!r}; this zkv reads version {FORMAT_VERSION}", source
        )
    world = rec.get("world")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise TraceError(line, f"header: world must be a positive integer, got {world!r}", source)
    layout = rec.get("layout")
    if layout is not None:
        try:
            layout = CacheLayout.from_wire(layout)
        except (P.ProtocolError, TypeError) as err:
            raise TraceError(line, f"header: bad layout: {getattr(err, 'reason', err)}", source) from None
    extra = {k: v for k, v in rec.items() if k not in ("zkv_trace", "world", "layout")}
    return Header(version, world, layout, line, extra)


def _body(rec: dict, line: int, source: str) -> tuple[bytes, str]:
    if "body_b64" in rec:
        try:
            return base64.b64decode(rec["body_b64"], validate=True), "raw body"
        except (ValueError, TypeError):
            raise TraceError(line, "body_b64 is not valid base64", source) from None
    op = rec.get("op")
    if op not in P.OPS:
        raise TraceError(line, f"unknown op {op!r}; expected one of {', '.join(P.OPS)}", source)
    extra: dict[str, Any] = {}
    try:
        src = decode_ids(rec["src"], "src") if rec.get("src") is not None else None
        dst = decode_ids(rec["dst"], "dst") if rec.get("dst") is not None else None
    except ValueError as err:
        raise TraceError(line, str(err), source) from None
    if rec.get("tier") is not None:
        if rec["tier"] not in P.TIERS:
            raise TraceError(line, f"tier must be gpu or cpu, got {rec['tier']!r}", source)
        extra["tier"] = rec["tier"]
    if rec.get("seed") is not None:
        if not isinstance(rec["seed"], int) or isinstance(rec["seed"], bool) or not 0 <= rec["seed"] <= P.MAX_SAFE_INT:
            raise TraceError(line, f"seed must be a non-negative integer, got {rec['seed']!r}", source)
        extra["seed"] = rec["seed"]
    if rec.get("keys") is not None:  # a put's or get's names: hex strings
        keys = rec["keys"]
        try:
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError
            extra["keys"] = [bytes.fromhex(k) for k in keys]
        except ValueError:
            raise TraceError(line, "keys must be a list of hex strings", source) from None
    if rec.get("ns") is not None:
        extra["ns"] = rec["ns"]
    n = len(src if src is not None else dst or [])
    return P.encode_body(op, src, dst, **extra), f"{op} {n} block{'s' if n != 1 else ''}"


def _label(value: Any, what: str, line: int, source: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
        raise TraceError(line, f"{what} must be a string or an integer, got {value!r}", source)
    return value


def parse_trace(lines: Iterable[str], source: str = "trace") -> Trace:
    """Parse and validate a trace; raise :class:`TraceError` naming the line."""
    parser = _Parser(source)
    for lineno, raw in enumerate(lines, 1):
        text = raw.strip()
        if text and not text.startswith("#"):
            parser.record(_json_record(text, lineno, source), lineno)
    return parser.finish()


def _json_record(text: str, line: int, source: str) -> dict:
    try:
        rec = json.loads(text)
    except ValueError as err:
        raise TraceError(line, f"not valid JSON: {err}", source) from None
    if not isinstance(rec, dict):
        raise TraceError(line, f"a record must be a JSON object, got {type(rec).__name__}", source)
    return rec


class _Parser:
    """The state of one parse: the header, the ops and tasks so far, and the
    clock of the current segment (an appended recording starts where the last
    one ended)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.header: Header | None = None
        self.ops: list[Op] = []
        self.tasks: dict[tuple[str, Any], TaskSpec] = {}
        self.next_task: dict[str, int] = collections.defaultdict(lambda: 1)
        self.segment = 0
        self.offset = 0.0
        self.seg_t = 0.0
        self.last_t = 0.0
        self.lineno = 0

    def fail(self, message: str) -> TraceError:
        return TraceError(self.lineno, message, self.source)

    def finish(self) -> Trace:
        if self.header is None:
            raise TraceError(0, "empty trace: no header line", self.source)
        return Trace(self.header, self.ops, self.tasks, self.source, self.lineno, self.segment + 1)

    def record(self, rec: dict, lineno: int) -> None:
        self.lineno = lineno
        if "zkv_trace" in rec:
            self._header(_header(rec, lineno, self.source))
            return
        header = self.header
        if header is None:
            raise self.fail('the first record must be the header, e.g. {"zkv_trace": 1, "world": 2, "layout": null}')
        ev = rec.get("ev")
        if ev not in EVENTS:
            raise self.fail(f"unknown record type ev={ev!r}; expected one of {', '.join(EVENTS)}")
        self._advance_clock(rec)
        if ev == "rank" and header.layout is None and isinstance(rec.get("layout"), dict):
            try:  # a broker that puts the layout it learnt into its rank records
                header.layout = CacheLayout.from_wire(rec["layout"])
            except (P.ProtocolError, TypeError):
                pass
        if ev in ("control", "rank", "note"):
            return  # information only
        keys = {"submit": _SUBMIT_KEYS, "outcome": _OUTCOME_KEYS}.get(ev, _CONTROL_KEYS)
        unknown = [k for k in rec if k not in keys and not k.startswith("_")]
        if unknown:
            plural = "s" if len(unknown) > 1 else ""
            raise self.fail(f"unknown field{plural} {', '.join(map(repr, unknown))} in a {ev} record")
        default_client = DEFAULT_CONTROL_CLIENT if ev in CONTROL_REQUESTS else DEFAULT_TASK_CLIENT
        client = str(_label(rec.get("client", default_client), "client", lineno, self.source))
        if self.segment:
            client = f"s{self.segment}/{client}"
        if ev == "submit":
            self._submit(rec, client)
        elif ev == "outcome":
            self._outcome(rec, client)
        else:
            self._control(rec, ev, client)

    def _header(self, h: Header) -> None:
        if self.header is None:
            self.header = h
            return
        if h.world != self.header.world:
            raise self.fail(
                f"appended session has world {h.world}, but the trace started with world {self.header.world}"
            )
        self.segment += 1
        self.offset, self.seg_t = self.last_t, 0.0

    def _advance_clock(self, rec: dict) -> None:
        t = _number(rec, "t", self.lineno, self.source)
        if t is None:
            t = self.seg_t
        elif t < self.seg_t:
            raise self.fail(f"time goes backwards: t={t} after t={self.seg_t}")
        self.seg_t = t
        self.last_t = self.offset + t

    def _submit(self, rec: dict, client: str) -> None:
        task = rec.get("task")
        if task is None:
            task = self.next_task[client]
        task = _label(task, "task", self.lineno, self.source)
        if isinstance(task, int):
            self.next_task[client] = max(self.next_task[client], task + 1)
        key = (client, task)
        if key in self.tasks:
            raise self.fail(f"task {task} of client {client} was already submitted at line {self.tasks[key].line}")
        body, summary = _body(rec, self.lineno, self.source)
        spec = TaskSpec(key, self.lineno, len(self.tasks), summary)
        if rec.get("expect") is not None:
            spec.expects.append((self.lineno, _expect_list(rec["expect"], P.OUTCOMES, self.lineno, self.source)))
        self.tasks[key] = spec
        self.ops.append(Op(self.lineno, "submit", self.last_t, client, task, body))

    def _outcome(self, rec: dict, client: str) -> None:
        task = _label(rec.get("task"), "task", self.lineno, self.source)
        submitted = self.tasks.get((client, task))
        if submitted is None:
            raise self.fail(f"outcome for task {task} of client {client}, which no earlier submit record names")
        outcome = rec.get("outcome")
        if outcome not in P.OUTCOMES:
            raise self.fail(f"unknown outcome {outcome!r}; expected one of {', '.join(P.OUTCOMES)}")
        submitted.recorded.append((self.lineno, outcome))
        submitted.expects.append((self.lineno, (outcome,)))

    def _control(self, rec: dict, ev: str, client: str) -> None:
        params = _control_params(rec, ev, self.lineno, self.source)
        expect = _expect_list(rec["expect"], None, self.lineno, self.source) if rec.get("expect") is not None else None
        self.ops.append(Op(self.lineno, ev, self.last_t, client, params=params, expect=expect))


def _control_params(rec: dict, ev: str, line: int, source: str) -> dict[str, Any]:
    """The parameters of a pause / clear / resume record, each checked."""
    params: dict[str, Any] = {}
    if rec.get("timeout_ms") is not None:
        v = rec["timeout_ms"]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise TraceError(line, f"timeout_ms must be a positive integer, got {v!r}", source)
        params["timeout_ms"] = v
    if ev == ControlOp.CLEAR and rec.get("keep_cpu") is not None:
        if not isinstance(rec["keep_cpu"], bool):
            raise TraceError(line, f"keep_cpu must be true or false, got {rec['keep_cpu']!r}", source)
        params["keep_cpu"] = rec["keep_cpu"]
    elif "keep_cpu" in rec:
        raise TraceError(line, f"keep_cpu belongs to clear, not {ev}", source)
    if ev == ControlOp.RESUME and rec.get("layout") is not None:
        if not isinstance(rec["layout"], dict):
            raise TraceError(line, 'resume layout must be an object like {"gpu_blocks": 128}', source)
        params["layout"] = rec["layout"]
    elif "layout" in rec:
        raise TraceError(line, f"layout belongs to resume, not {ev}", source)
    return params


def load_trace(path: str, stdin: TextIO | None = None) -> Trace:
    """Read a trace file, or standard input when ``path`` is ``-``."""
    if path == "-":
        return parse_trace((stdin or sys.stdin), "<stdin>")
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, path)
    except UnicodeDecodeError as err:
        raise TraceError(0, f"not a UTF-8 text file ({err.reason})", path) from None


def check_recording(trace: Trace) -> list[dict[str, Any]]:
    """A recording's own books: every recorded submit has exactly one outcome record."""
    problems = []
    for spec in trace.tasks.values():
        if len(spec.recorded) != 1:
            lines = [spec.line] + [ln for ln, _ in spec.recorded]
            what = (
                "no outcome record"
                if not spec.recorded
                else f"{len(spec.recorded)} outcome records ({', '.join(o for _, o in spec.recorded)})"
            )
            problems.append(
                {
                    "kind": "recorded_outcomes",
                    "lines": lines,
                    "task": spec.label,
                    "message": f"task {spec.label} (line {spec.line}) has {what}",
                }
            )
    return problems
