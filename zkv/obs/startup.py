"""When each phase of a process's start ended, on the host's monotonic clock
(``CLOCK_MONOTONIC`` is one clock for every process of a host, so a parent
that notes when it started the process can subtract).

A rank worker marks its phases (``zkv worker --startup-times FILE``): the
interpreter reaching zkv, the command line parsed, its modules imported
(torch), its tiers mapped, its READY sent, the broker's welcome, its cache
ready (the resume that follows a restart acked), its first task done.  Each
phase is marked once, the first time; nothing is written unless a file is
named, so the marks cost a dict lookup on the paths that make them.
``zkv bench restart`` (``harness/bus/restart_bench.py``) reads the file.
"""

from __future__ import annotations

import json
import os
import time

_marks: dict[str, float] = {}
_fd = -1


def mark(phase: str) -> None:
    """``phase`` ended now (only its first end counts)."""
    if phase in _marks:
        return
    _marks[phase] = now = time.monotonic()
    if _fd >= 0:
        _write(phase, now)


def record_to(path: str) -> None:
    """Append every phase marked so far, and each one marked later, to ``path``
    (one JSON object per line: ``phase``, ``t`` in monotonic seconds, ``pid``)."""
    global _fd
    _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for phase, t in _marks.items():
        _write(phase, t)


def _write(phase: str, t: float) -> None:
    os.write(_fd, (json.dumps({"phase": phase, "t": t, "pid": os.getpid()}) + "\n").encode())


def read(path: str) -> dict[int, dict[str, float]]:
    """The phases a file holds, per process id."""
    out: dict[int, dict[str, float]] = {}
    try:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out.setdefault(int(rec["pid"]), {}).setdefault(str(rec["phase"]), float(rec["t"]))
    except FileNotFoundError:
        pass
    return out
