"""A fleet for people: ``zkv status --fleet`` as one row per bus, and the
report of a fleet pause / clear / resume as one row per bus with its answer,
when it came and where the bus is left.

Both read plain dicts: the per-bus objects ``zkv status --fleet --json``
prints (one a line) and the fleet record ``zkv pause --fleet --json``
prints (docs/traces.md, "Fleet records"), so they work on saved JSON too.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..wire.vocab import Outcome
from .status_view import counted, table


def _ms(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _ranks(st: dict[str, Any]) -> str:
    ranks = st.get("ranks") or []
    alive = sum(1 for r in ranks if isinstance(r, dict) and r.get("alive"))
    world = st.get("world")
    return f"{alive}/{world}" if isinstance(world, int) else str(alive)


def render_fleet_status(rows: Iterable[dict[str, Any]]) -> str:
    """One row per bus: state, epoch, generation, ranks alive of the world,
    inflight and queued tasks, and how long its answer took; a bus that did
    not answer says why below the table."""
    body, notes = [], []
    rows = list(rows)
    for r in rows:
        name = str(r.get("bus", "?"))
        if r.get("ok"):
            pending = r.get("pending_op")
            state = str(r.get("state", "?")).upper() + (f" ({pending})" if pending else "")
            cells = [state, str(r.get("epoch", "-")), str(r.get("gen", "-")), _ranks(r)]
            cells += [str(r.get("inflight", "-")), str(r.get("queued", "-"))]
        else:
            cells = [str(r.get("code", "no answer")).upper().replace("_", " "), *["-"] * 5]
            notes.append(f"{name}: {r.get('reason', '')}")
        body.append([name, *cells, _ms(r.get("ms")), str(r.get("broker", "-"))])
    header = ["bus", "state", "epoch", "generation", "ranks alive", "inflight", "queued", "ms", "broker"]
    answered = sum(1 for r in rows if r.get("ok"))
    lines = [f"fleet of {counted(len(rows), 'bus')}: {answered} answered", "", *table(header, body)]
    return "\n".join(lines + ([""] + notes if notes else []))


def render_fleet_report(record: dict[str, Any]) -> str:
    """A fleet operation's record as a headline and one row per bus."""
    buses = record.get("buses") or []
    op, ms = record.get("op", "?"), _ms(record.get("ms"))
    head = f"fleet {op} {'ok' if record.get('ok') else 'FAILED'}: {counted(len(buses), 'bus')} in {ms} ms"
    if record.get("slowest"):
        slowest: dict[str, Any] = next((b for b in buses if b.get("bus") == record["slowest"]), {})
        head += f" (slowest {record['slowest']} at {_ms(slowest.get('ms'))} ms)"
    body, notes = [], []
    for b in buses:
        rollback = b.get("rollback", "")
        if rollback in (Outcome.OK, "noop"):
            rollback = f"{rollback} ({_ms(b.get('rollback_ms'))} ms)" if "rollback_ms" in b else rollback
        elif rollback:  # a resume it needed that did not happen: the operator's to look at
            rollback = f"NOT RESUMED ({rollback}" + (f", {_ms(b['rollback_ms'])} ms)" if "rollback_ms" in b else ")")
        reply = b.get("reply") or {}
        note = reply.get("note", "") if isinstance(reply, dict) else ""
        if isinstance(reply, dict) and isinstance(reply.get("world"), int) and "ranks_acked" in reply:
            acked = f"{reply['ranks_acked']} of {reply['world']} ranks acked"
            note = f"{note}; {acked}" if note else acked
        body.append([str(b.get("bus", "?")), str(b.get("outcome", "?")), _ms(b.get("ms")), b.get("state") or "unknown"])
        body[-1] += [rollback or "-", note or "-"]
        for key in ("reason", "rollback_reason"):
            if b.get(key):
                notes.append(f"{b.get('bus')}: {b[key]}")
    lines = [head, "", *table(["bus", "outcome", "ms", "now", "resumed by rollback", "note"], body)]
    return "\n".join(lines + ([""] + notes if notes else []))
