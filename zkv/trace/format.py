"""The trace format: record kinds and fields, the parsed form (:class:`Trace`),
and writing records.  ``docs/traces.md`` is the normative description.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from typing import IO, Any, Iterable

from ..wire.layout import CacheLayout
from ..wire.vocab import CLIENT_OPS

FORMAT_VERSION = 1
#: The control requests a client makes; the protocol's other control op, ``run``, is the broker's own.
CONTROL_REQUESTS = CLIENT_OPS
#: Records the replayer acts on, and records that are information only.
ACTION_EVENTS = ("submit", *CONTROL_REQUESTS)
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


def header_record(world: int, layout: CacheLayout | dict | None, **extra: Any) -> dict[str, Any]:
    if isinstance(layout, CacheLayout):
        layout = layout.to_wire()
    return {"zkv_trace": FORMAT_VERSION, "world": world, "layout": layout, **extra}


def dump_records(records: Iterable[dict[str, Any]], out: IO[str]) -> None:
    for rec in records:
        out.write(json.dumps(rec) + "\n")


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
