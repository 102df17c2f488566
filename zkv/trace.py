"""Traces: the JSON Lines format, its parser, the broker's recorder, and
synthetic trace generators.  No sockets here (sans-IO): ``replay.py`` owns
the thin driver that talks to a bus.

A trace is a header line followed by one record per line (``docs/traces.md``
is the normative description)::

    {"zkv_trace": 1, "world": 2, "layout": {"layers": 2, "gpu_blocks": 64, ...}}
    {"t": 0.000, "ev": "submit", "client": "c0", "task": 1, "op": "swap_out", "src": "0-3", "dst": [9, 4, 7, 8], "expect": "ok"}
    {"t": 0.010, "ev": "pause", "client": "ctl", "expect": "ok"}
    {"t": 0.011, "ev": "outcome", "client": "c0", "task": 1, "outcome": "ok", "latency_ms": 1.3}

Hand-written traces and ``zkv broker --record`` recordings are the same
format: a recording is a trace whose expectations are ``outcome`` records, so
any recording can be replayed as it is.
"""

from __future__ import annotations

import array
import base64
import collections
import datetime as _dt
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence, TextIO

import msgpack

from .wire import protocol as P
from .wire.layout import CacheLayout

FORMAT_VERSION = 1
CONTROL_OPS = ("pause", "clear", "resume")
#: Records the replayer acts on, and records that are information only.
ACTION_EVENTS = ("submit", *CONTROL_OPS)
INFO_EVENTS = ("outcome", "control", "rank", "note")
EVENTS = ACTION_EVENTS + INFO_EVENTS
DEFAULT_TASK_CLIENT = "c0"
DEFAULT_CONTROL_CLIENT = "ctl"
LAYOUT_ENV = "ZKV_TRACE_LAYOUT"  # JSON layout for a recorder's header (the broker does not know it)

_SUBMIT_KEYS = {"t", "ev", "client", "task", "op", "src", "dst", "tier", "seed", "body_b64", "expect", "note"}
_CONTROL_KEYS = {"t", "ev", "client", "expect", "timeout_ms", "keep_cpu", "layout", "note"}
_OUTCOME_KEYS = {"t", "ev", "client", "task", "outcome", "reason", "latency_ms", "note"}


class TraceError(ValueError):
    """A trace that cannot be replayed; ``line`` is 1-based (0: the whole file)."""

    def __init__(self, line: int, message: str, source: str = "trace"):
        super().__init__(f"{source}, line {line}: {message}" if line else f"{source}: {message}")
        self.line = line
        self.message = message
        self.source = source


# --- block-id lists: JSON arrays or compact range strings ------------------------------


def encode_ids(ids: Sequence[int]) -> list[int] | str:
    """``[0,1,2,3,8]`` -> ``"0-3,8"`` when runs make it shorter, else the list."""
    n = len(ids)
    if n < 3:
        return list(ids)
    first, last = ids[0], ids[-1]
    if last - first == n - 1 and first >= 0 and list(ids) == list(range(first, last + 1)):
        return f"{first}-{last}"  # the common case: one run
    starts = [0] + [i for i in range(1, n) if ids[i] != ids[i - 1] + 1]
    ends = starts[1:] + [n]
    if max(e - s for s, e in zip(starts, ends)) < 3 or min(ids) < 0:
        return list(ids)  # no run worth a range ("-" would be ambiguous for negatives)
    parts: list[str] = []
    for s, e in zip(starts, ends):
        if e - s >= 3:
            parts.append(f"{ids[s]}-{ids[e - 1]}")
        else:
            parts.extend(str(x) for x in ids[s:e])
    return ",".join(parts)


def decode_ids(value: Any, what: str = "ids") -> list[int]:
    """A JSON array of integers, or a string like ``"0-3,8,10-11"``."""
    if isinstance(value, list):
        for x in value:
            if not isinstance(x, int) or isinstance(x, bool) or not -2**31 <= x < 2**31:
                raise ValueError(f"{what}: {x!r} is not a block id (an int32)")
        return value
    if isinstance(value, str):
        ids: list[int] = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            try:
                if "-" in part:
                    lo, hi = part.split("-", 1)
                    a, b = int(lo), int(hi)
                    if b < a:
                        raise ValueError
                    ids.extend(range(a, b + 1))
                else:
                    ids.append(int(part))
            except ValueError:
                raise ValueError(f"{what}: {part!r} is not an id or a range like 4-7") from None
        if len(ids) > P.MAX_IDS:
            raise ValueError(f"{what}: more than {P.MAX_IDS} ids")
        return ids
    raise ValueError(f"{what} must be a list of ids or a range string like \"0-3,8\", got {type(value).__name__}")


# --- the parsed form --------------------------------------------------------------------


@dataclass
class Header:
    version: int
    world: int
    layout: CacheLayout | None
    line: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Op:
    """One replayable record: a submit or a control request."""

    line: int
    ev: str  # submit pause clear resume
    t: float  # seconds from the start of the trace
    client: str
    task: Any = None  # submit: the trace's task label (scoped by client)
    body: bytes = b""  # submit: the encoded task body
    params: dict[str, Any] = field(default_factory=dict)  # control: keep_cpu, layout, timeout_ms
    expect: tuple[str, ...] | None = None  # control: results allowed ("ok", "noop", error codes)

    @property
    def key(self) -> tuple[str, Any]:
        return (self.client, self.task)


@dataclass
class TaskSpec:
    """What the trace says about one task."""

    key: tuple[str, Any]
    line: int  # the submit record
    index: int  # submission order in the trace
    summary: str  # "swap_out 4 blocks", for messages
    expects: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)  # (line, allowed outcomes)
    recorded: list[tuple[int, str]] = field(default_factory=list)  # outcome records: (line, outcome)

    @property
    def label(self) -> str:
        return f"{self.key[0]}/{self.key[1]}"


@dataclass
class Trace:
    header: Header
    ops: list[Op]
    tasks: dict[tuple[str, Any], TaskSpec]
    source: str = "trace"
    lines: int = 0
    segments: int = 1

    @property
    def world(self) -> int:
        return self.header.world

    @property
    def layout(self) -> CacheLayout | None:
        return self.header.layout

    def controls(self) -> list[Op]:
        return [op for op in self.ops if op.ev != "submit"]

    def submits(self) -> list[Op]:
        return [op for op in self.ops if op.ev == "submit"]


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
        raise TraceError(line, f"unsupported trace format version {version!r}; this zkv reads version {FORMAT_VERSION}", source)
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
    n = len(src if src is not None else dst or [])
    # Pack here: protocol.pack_ids imports torch (seconds) just to test for a tensor.
    return P.encode_body(op, _pack(src), _pack(dst), **extra), f"{op} {n} block{'s' if n != 1 else ''}"


def _pack(ids: list[int] | None) -> bytes | None:
    if ids is None:
        return None
    arr = array.array("i", ids)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _label(value: Any, what: str, line: int, source: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
        raise TraceError(line, f"{what} must be a string or an integer, got {value!r}", source)
    return value


def parse_trace(lines: Iterable[str], source: str = "trace") -> Trace:
    """Parse and validate a trace; raise :class:`TraceError` naming the line."""
    header: Header | None = None
    ops: list[Op] = []
    tasks: dict[tuple[str, Any], TaskSpec] = {}
    next_task: dict[str, int] = collections.defaultdict(lambda: 1)
    segment = 0
    offset = 0.0  # a later segment (an appended recording) starts where the last ended
    seg_t = 0.0
    last_t = 0.0
    lineno = 0
    for lineno, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            rec = json.loads(text)
        except ValueError as err:
            raise TraceError(lineno, f"not valid JSON: {err}", source) from None
        if not isinstance(rec, dict):
            raise TraceError(lineno, f"a record must be a JSON object, got {type(rec).__name__}", source)
        if "zkv_trace" in rec:
            h = _header(rec, lineno, source)
            if header is None:
                header = h
            else:
                if h.world != header.world:
                    raise TraceError(lineno, f"appended session has world {h.world}, but the trace started with world {header.world}", source)
                segment += 1
                offset, seg_t = last_t, 0.0
            continue
        if header is None:
            raise TraceError(lineno, 'the first record must be the header, e.g. {"zkv_trace": 1, "world": 2, "layout": null}', source)
        ev = rec.get("ev")
        if ev not in EVENTS:
            raise TraceError(lineno, f"unknown record type ev={ev!r}; expected one of {', '.join(EVENTS)}", source)
        t = _number(rec, "t", lineno, source)
        if t is None:
            t = seg_t
        elif t < seg_t:
            raise TraceError(lineno, f"time goes backwards: t={t} after t={seg_t}", source)
        seg_t = t
        last_t = offset + t
        if ev == "rank" and header.layout is None and isinstance(rec.get("layout"), dict):
            try:  # a broker that puts the layout it learnt into its rank records
                header.layout = CacheLayout.from_wire(rec["layout"])
            except (P.ProtocolError, TypeError):
                pass
        if ev in ("control", "rank", "note"):
            continue  # information only
        keys = {"submit": _SUBMIT_KEYS, "outcome": _OUTCOME_KEYS}.get(ev, _CONTROL_KEYS)
        unknown = [k for k in rec if k not in keys and not k.startswith("_")]
        if unknown:
            raise TraceError(lineno, f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in a {ev} record", source)
        default_client = DEFAULT_CONTROL_CLIENT if ev in CONTROL_OPS else DEFAULT_TASK_CLIENT
        client = str(_label(rec.get("client", default_client), "client", lineno, source))
        if segment:
            client = f"s{segment}/{client}"
        if ev == "submit":
            task = rec.get("task")
            if task is None:
                task = next_task[client]
            task = _label(task, "task", lineno, source)
            if isinstance(task, int):
                next_task[client] = max(next_task[client], task + 1)
            key = (client, task)
            if key in tasks:
                raise TraceError(lineno, f"task {task} of client {client} was already submitted at line {tasks[key].line}", source)
            body, summary = _body(rec, lineno, source)
            spec = TaskSpec(key, lineno, len(tasks), summary)
            if rec.get("expect") is not None:
                spec.expects.append((lineno, _expect_list(rec["expect"], P.OUTCOMES, lineno, source)))
            tasks[key] = spec
            ops.append(Op(lineno, ev, last_t, client, task, body))
        elif ev == "outcome":
            task = _label(rec.get("task"), "task", lineno, source)
            spec = tasks.get((client, task))
            if spec is None:
                raise TraceError(lineno, f"outcome for task {task} of client {client}, which no earlier submit record names", source)
            outcome = rec.get("outcome")
            if outcome not in P.OUTCOMES:
                raise TraceError(lineno, f"unknown outcome {outcome!r}; expected one of {', '.join(P.OUTCOMES)}", source)
            spec.recorded.append((lineno, outcome))
            spec.expects.append((lineno, (outcome,)))
        else:
            params: dict[str, Any] = {}
            if rec.get("timeout_ms") is not None:
                v = rec["timeout_ms"]
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise TraceError(lineno, f"timeout_ms must be a positive integer, got {v!r}", source)
                params["timeout_ms"] = v
            if ev == "clear" and rec.get("keep_cpu") is not None:
                if not isinstance(rec["keep_cpu"], bool):
                    raise TraceError(lineno, f"keep_cpu must be true or false, got {rec['keep_cpu']!r}", source)
                params["keep_cpu"] = rec["keep_cpu"]
            elif "keep_cpu" in rec:
                raise TraceError(lineno, f"keep_cpu belongs to clear, not {ev}", source)
            if ev == "resume" and rec.get("layout") is not None:
                if not isinstance(rec["layout"], dict):
                    raise TraceError(lineno, "resume layout must be an object like {\"gpu_blocks\": 128}", source)
                params["layout"] = rec["layout"]
            elif "layout" in rec:
                raise TraceError(lineno, f"layout belongs to resume, not {ev}", source)
            expect = _expect_list(rec["expect"], None, lineno, source) if rec.get("expect") is not None else None
            ops.append(Op(lineno, ev, last_t, client, params=params, expect=expect))
    if header is None:
        raise TraceError(0, "empty trace: no header line", source)
    return Trace(header, ops, tasks, source, lineno, segment + 1)


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
            what = "no outcome record" if not spec.recorded else f"{len(spec.recorded)} outcome records ({', '.join(o for _, o in spec.recorded)})"
            problems.append({"kind": "recorded_outcomes", "lines": lines, "task": spec.label,
                             "message": f"task {spec.label} (line {spec.line}) has {what}"})
    return problems


# --- comparing two traces' outcomes ----------------------------------------------------


def outcome_table(trace: Trace) -> dict[tuple[int, int], tuple[list[str], int]]:
    """(client rank, task index) -> (recorded outcome sequence, submit line).

    Clients are matched by what they submit, not by name (a recording names
    clients by ZMQ identity): a client's signature is its sequence of task
    bodies; clients with equal signatures are told apart by first appearance.
    """
    by_client: dict[str, list[TaskSpec]] = collections.defaultdict(list)
    for spec in sorted(trace.tasks.values(), key=lambda s: s.index):
        by_client[spec.key[0]].append(spec)
    bodies = {op.key: op.body for op in trace.submits()}
    clients = sorted(by_client, key=lambda c: (tuple(bodies[s.key] for s in by_client[c]), by_client[c][0].index))
    table = {}
    for ci, client in enumerate(clients):
        for ti, spec in enumerate(by_client[client]):
            table[(ci, ti)] = ([o for _, o in spec.recorded], spec.line)
    return table


def compare_outcomes(a: Trace, b: Trace) -> list[dict[str, Any]]:
    """Tasks whose recorded outcome sequences differ between two traces."""
    ta, tb = outcome_table(a), outcome_table(b)
    bodies_a = {op.key: op.body for op in a.submits()}
    bodies_b = {op.key: op.body for op in b.submits()}
    if sorted(bodies_a.values()) != sorted(bodies_b.values()):
        return [{"kind": "different_tasks", "lines_a": [], "lines_b": [],
                 "message": f"the traces do not submit the same tasks ({len(bodies_a)} vs {len(bodies_b)} submits, or different bodies)"}]
    diffs = []
    for k in sorted(set(ta) | set(tb)):
        (oa, la), (ob, lb) = ta.get(k, ([], 0)), tb.get(k, ([], 0))
        if oa != ob:
            diffs.append({"kind": "different_outcomes", "lines_a": [la], "lines_b": [lb],
                          "message": f"{a.source} line {la}: {oa or 'no outcome'} but {b.source} line {lb}: {ob or 'no outcome'}"})
    return diffs


# --- writing ----------------------------------------------------------------------------


def header_record(world: int, layout: CacheLayout | dict | None, **extra: Any) -> dict[str, Any]:
    if isinstance(layout, CacheLayout):
        layout = layout.to_wire()
    return {"zkv_trace": FORMAT_VERSION, "world": world, "layout": layout, **extra}


def dump_records(records: Iterable[dict[str, Any]], out: TextIO) -> None:
    for rec in records:
        out.write(json.dumps(rec) + "\n")


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --- the broker's recorder --------------------------------------------------------------


def _submit_fields(body: bytes) -> dict[str, Any]:
    try:
        b = P.decode_body(body)
    except P.ProtocolError as err:
        return {"body_b64": base64.b64encode(body).decode("ascii"), "note": f"undecodable body: {err.reason}"}
    fields: dict[str, Any] = {"op": b.op}
    if b.src:
        fields["src"] = encode_ids(b.src)
    if b.dst:
        fields["dst"] = encode_ids(b.dst)
    if b.op in ("fill", "checksum"):
        fields["tier"] = b.tier
    if b.op == "fill":
        fields["seed"] = b.seed
    return fields


def encode_event(ev: dict[str, Any], t0: float) -> dict[str, Any]:
    """One broker Record event -> one trace record (times relative to ``t0``)."""
    kind = ev.get("ev")
    t = round(max(0.0, ev.get("t", t0) - t0), 6)
    if kind == "submit":
        return {"t": t, "ev": "submit", "client": ev.get("client"), "task": ev.get("task"), **_submit_fields(ev.get("body", b""))}
    rest = {k: v for k, v in ev.items() if k not in ("ev", "t", "op", "body")}
    if kind == "request":
        return {"t": t, "ev": ev.get("op"), **{k: v for k, v in rest.items() if k in _CONTROL_KEYS}}
    if kind == "outcome":
        if not rest.get("reason"):
            rest.pop("reason", None)
        return {"t": t, "ev": "outcome", **rest}
    op = {"op": ev["op"]} if "op" in ev else {}
    if kind in ("control", "rank"):
        return {"t": t, "ev": kind, **op, **rest}
    return {"t": t, "ev": "note", "event": kind, **op, **rest}


def format_events(events: Iterable[dict[str, Any]], t0: float) -> tuple[str, int, int]:
    """JSON lines for a batch of events: (text, lines, events that failed to encode)."""
    lines = []
    errors = 0
    for ev in events:
        try:
            lines.append(json.dumps(encode_event(ev, t0), separators=(",", ":"), default=str))
        except Exception:  # a record must never take the broker down
            errors += 1
    return ("\n".join(lines) + "\n" if lines else ""), len(lines), errors


_HELPER = "import sys, zkv.trace as t; t._helper_main(sys.argv[1], float(sys.argv[2]))"
_ACK_TIMEOUT = 30.0


def _helper_main(path: str, t0: float) -> None:
    """The recorder's writer process: msgpack batches on stdin -> JSON lines in ``path``.

    It ignores SIGINT (a Ctrl-C in the terminal must not cut the recording
    short) and ends at end of input, after writing everything it was sent.
    """
    import msgpack

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)
    written = errors = 0
    with open(path, "a", encoding="utf-8") as out:
        while True:
            data = sys.stdin.buffer.read1(1 << 20)
            if not data:
                return
            unpacker.feed(data)
            for seq, batch in unpacker:
                text, n, bad = format_events(batch, t0)
                out.write(text)
                out.flush()
                written += n
                errors += bad
                sys.stdout.buffer.write(f"{seq} {written} {errors}\n".encode())
                sys.stdout.buffer.flush()


class TraceRecorder:
    """The ``zkv broker --record FILE`` sink: ``recorder(event)`` per broker Record.

    On the broker's thread a call only appends the event to a deque (thread
    safe, about 0.1 us).  Every ``flush_interval`` seconds (0.25), and on close, a
    writer thread hands the batch, packed with msgpack (under 1 us a task), to
    a helper process that decodes task bodies, formats JSON and appends to the
    file, so that work (some 15 us a task) never runs in the broker process.
    Without the helper (it cannot start, or dies) the writer thread does it.

    Times are seconds since the recorder started.  The file is appended to:
    each broker session adds its own header (a new segment when replayed).
    """

    def __init__(self, path: str, world: int, layout: CacheLayout | dict | None = None, *,
                 flush_interval: float = 0.25, clock=time.monotonic, helper: bool = True):
        if layout is None and os.environ.get(LAYOUT_ENV):
            try:
                layout = CacheLayout.from_wire(json.loads(os.environ[LAYOUT_ENV]))
            except (ValueError, TypeError, P.ProtocolError):
                layout = None
        self.path = path
        self.t0 = clock()
        self.flush_interval = flush_interval
        self.written = 0
        self.errors = 0
        self._queue: collections.deque[dict] = collections.deque()
        self._io = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._seq = 0
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(header_record(world, layout, source="record", created=_now_iso(), pid=os.getpid())) + "\n")
        self._file: TextIO | None = None
        self._proc: subprocess.Popen | None = None
        if helper:
            try:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # find zkv as we did
                self._proc = subprocess.Popen([sys.executable, "-c", _HELPER, path, repr(self.t0)], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, bufsize=0, start_new_session=True, env=env)
            except OSError:
                self._proc = None
        self._thread = threading.Thread(target=self._run, name="zkv-trace-writer", daemon=True)
        self._thread.start()

    @property
    def helper_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def __call__(self, event: dict[str, Any]) -> None:
        self._queue.append(event)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval):
            self.flush()

    def flush(self) -> None:
        """Write everything queued so far; returns once it is in the file."""
        with self._io:
            q = self._queue
            batch = [q.popleft() for _ in range(len(q))]
            if batch:
                self._write(batch)

    def _write(self, batch: list[dict]) -> None:
        if self._proc is not None:
            try:
                self._seq += 1
                self._proc.stdin.write(msgpack.packb([self._seq, batch], use_bin_type=True, default=str))  # type: ignore[union-attr]
                self._proc.stdin.flush()  # type: ignore[union-attr]
                ack = self._read_ack()
                seq, self.written, self.errors = (int(x) for x in ack.split())
                if seq == self._seq:
                    return
            except (OSError, ValueError, TypeError):
                pass
            self._helper_failed()  # the batch goes through the fallback (it may repeat a few lines)
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        text, n, bad = format_events(batch, self.t0)
        self._file.write(text)
        self._file.flush()
        self.written += n
        self.errors += bad

    def _read_ack(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        data = b""
        deadline = time.monotonic() + _ACK_TIMEOUT
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise OSError("the trace writer process did not answer")
            chunk = os.read(fd, 256)
            if not chunk:
                raise OSError("the trace writer process exited")
            data += chunk
        return data.decode()

    def _helper_failed(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self.errors += 1
            proc.kill()
            proc.wait(timeout=5)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        """Write what is queued, stop the writer thread and the helper (bounded)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=_ACK_TIMEOUT)
        self.flush()
        with self._io:
            proc, self._proc = self._proc, None
            if proc is not None:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.close()
                try:
                    proc.wait(timeout=_ACK_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
                proc.stdout.close()
            if self._file is not None:
                self._file.close()


# --- synthetic traces -------------------------------------------------------------------

SHAPES = ("steady", "bursty", "rl-cycle")


def _task_fields(rng: random.Random, layout: CacheLayout, i: int, max_blocks: int) -> dict[str, Any]:
    k = rng.randint(1, max(1, min(max_blocks, layout.gpu_blocks, layout.cpu_blocks)))
    gpu = sorted(rng.sample(range(layout.gpu_blocks), k))
    cpu = sorted(rng.sample(range(layout.cpu_blocks), k))
    if i % 2 == 0:
        return {"op": "swap_out", "src": encode_ids(gpu), "dst": encode_ids(cpu)}
    return {"op": "swap_in", "src": encode_ids(cpu), "dst": encode_ids(gpu)}


def generate(shape: str, tasks: int = 100, seed: int = 0, *, world: int = 2, layout: CacheLayout | None = None,
             rate: float = 200.0, clients: int | None = None, burst: int = 16, gap: float = 0.05,
             every: int = 20, held: int = 2, max_blocks: int = 8) -> Iterator[dict[str, Any]]:
    """Records of a synthetic trace (header first), with the outcome each task should get.

    - ``steady``: tasks at ``rate`` per second, round-robin over ``clients`` (1).
    - ``bursty``: bursts of ``burst`` tasks at one instant, ``gap`` s apart, over ``clients`` (2).
    - ``rl-cycle``: tasks at ``rate`` throughout; after every ``every`` tasks a
      ``ctl`` client pauses, ``held`` tasks arrive (held, then cancelled by the
      clear), it clears, ``held`` tasks arrive (rejected), and it resumes.
      Tasks before a pause may be ``ok`` or, if still queued when it came,
      ``cancelled`` (the checker's FIFO rule keeps that honest).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    if tasks < 0 or rate <= 0 or burst < 1 or every < 1 or held < 0 or max_blocks < 1:
        raise ValueError("tasks, held must be >= 0; rate, burst, every, max_blocks must be positive")
    layout = layout or CacheLayout()
    rng = random.Random(seed)
    n_clients = clients or (2 if shape == "bursty" else 1)
    yield header_record(world, layout, source="gen", shape=shape, seed=seed, tasks=tasks)
    counters = [0] * n_clients

    def task(i: int, t: float, expect: str) -> dict[str, Any]:
        c = i % n_clients
        counters[c] += 1
        return {"t": round(t, 6), "ev": "submit", "client": f"c{c}", "task": counters[c],
                **_task_fields(rng, layout, i, max_blocks), "expect": expect}

    if shape == "steady":
        for i in range(tasks):
            yield task(i, i / rate, "ok")
        return
    if shape == "bursty":
        for i in range(tasks):
            yield task(i, (i // burst) * gap, "ok")
        return
    # rl-cycle
    dt = 1.0 / rate
    t = 0.0
    i = 0
    running = 0
    phase = "running"
    phase_start = 0
    phase_left = 0
    while i < tasks or phase != "running":
        if phase == "running" and running == every and i < tasks:
            yield {"t": round(t, 6), "ev": "pause", "client": DEFAULT_CONTROL_CLIENT, "expect": "ok"}
            phase, phase_left, running = "paused", held, 0
            continue
        if phase == "paused" and (phase_left == 0 or i >= tasks):
            yield {"t": round(t, 6), "ev": "clear", "client": DEFAULT_CONTROL_CLIENT, "expect": "ok"}
            phase, phase_left = "cleared", held
            continue
        if phase == "cleared" and (phase_left == 0 or i >= tasks):
            yield {"t": round(t, 6), "ev": "resume", "client": DEFAULT_CONTROL_CLIENT, "expect": "ok"}
            phase, phase_start = "running", i
            continue
        expect: Any = {"running": "ok", "paused": "cancelled", "cleared": "rejected"}[phase]
        if phase == "running" and phase_start + every < tasks:
            # A pause and a clear follow: a task still queued behind the ranks'
            # credits when the pause comes is held, then cancelled by the clear.
            expect = ["ok", "cancelled"]
        yield task(i, t, expect)
        i += 1
        t += dt
        if phase == "running":
            running += 1
        else:
            phase_left -= 1
