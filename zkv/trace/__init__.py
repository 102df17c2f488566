"""Traces: the JSON Lines format, its parser, the broker's recorder, and
synthetic trace generators.  No sockets here (sans-IO): ``zkv.replay`` owns
the thin driver that talks to a bus.

A trace is a header line followed by one record per line (``docs/traces.md``
is the normative description)::

    {"zkv_trace": 1, "world": 2, "layout": {"layers": 2, "gpu_blocks": 64, ...}}
    {"t": 0.000, "ev": "submit", "client": "c0", "task": 1, "op": "swap_out", "src": "0-3", "dst": [9, 4, 7, 8]}
    {"t": 0.010, "ev": "pause", "client": "ctl", "expect": "ok"}
    {"t": 0.011, "ev": "outcome", "client": "c0", "task": 1, "outcome": "ok", "latency_ms": 1.3}

Hand-written traces and ``zkv broker --record`` recordings are the same
format: a recording is a trace whose expectations are ``outcome`` records, so
any recording can be replayed as it is.

``format`` (record kinds, the parsed form, writing), ``parse`` (parser,
loader, a recording's books), ``compare`` (two traces' outcomes),
``synthetic`` (generated traces), ``recorder`` (the broker's sink).
"""

from ..wire.ids import decode_ids, encode_ids
from .compare import compare_outcomes, outcome_table
from .format import (
    ACTION_EVENTS,
    CONTROL_REQUESTS,
    DEFAULT_CONTROL_CLIENT,
    DEFAULT_TASK_CLIENT,
    EVENTS,
    FORMAT_VERSION,
    INFO_EVENTS,
    LAYOUT_ENV,
    Header,
    Op,
    TaskSpec,
    Trace,
    TraceError,
    dump_records,
    header_record,
)
from .parse import check_recording, load_trace, parse_trace
from .recorder import TraceRecorder, encode_event, format_events
from .synthetic import SHAPES, generate

__all__ = [
    "ACTION_EVENTS",
    "CONTROL_REQUESTS",
    "DEFAULT_CONTROL_CLIENT",
    "DEFAULT_TASK_CLIENT",
    "EVENTS",
    "FORMAT_VERSION",
    "INFO_EVENTS",
    "LAYOUT_ENV",
    "SHAPES",
    "Header",
    "Op",
    "TaskSpec",
    "Trace",
    "TraceError",
    "TraceRecorder",
    "check_recording",
    "compare_outcomes",
    "decode_ids",
    "dump_records",
    "encode_event",
    "encode_ids",
    "format_events",
    "generate",
    "header_record",
    "load_trace",
    "outcome_table",
    "parse_trace",
]
