"""The fleet forms of ``zkv status``, ``pause``, ``clear`` and ``resume``:
several ``--broker`` options or ``--fleet FILE`` act on every bus at once
through ``zkv.Fleet`` (docs/deploy.md, "A fleet of buses"): one deadline,
all or nothing, one row per bus.  ``--json`` prints the fleet record of an
operation, or one status object per bus (one a line)."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import click

from ..fleet import Fleet, FleetError, FleetReport, load_fleet_file
from ..fleet.decision import Answer
from ..fleet.spec import CURVE_FIELDS, fleet_of
from ..obs.fleet_view import render_fleet_report, render_fleet_status
from ..obs.status_view import counted
from ..wire.replies import ControlReply
from ..wire.vocab import ControlOp
from .options import fail, layout_change, sigterm_as_interrupt
from .reach import usage_error


def run_fleet(
    handler: Callable, brokers: tuple[str, ...], fleet_file: str | None, timeout: float, as_json: bool, kw: dict
) -> None:
    """Build the fleet from ``--broker`` options or ``--fleet`` (the Curve
    options are every bus's default) and run ``handler`` over it."""
    curve = {f: kw.pop(f, None) for f in CURVE_FIELDS}
    from click.core import ParameterSource

    given = click.get_current_context().get_parameter_source("broker")
    if fleet_file and given is ParameterSource.COMMANDLINE:
        usage_error("give the buses as --fleet FILE or as --broker options, not both")
    try:
        specs = load_fleet_file(fleet_file, curve) if fleet_file else fleet_of(brokers, curve)
        fleet = Fleet(specs, timeout=timeout)
    except ValueError as err:
        usage_error(str(err))
    with fleet:
        handler(fleet, timeout, as_json, **kw)


def status_rows(report: FleetReport) -> list[dict[str, Any]]:
    """Per bus, what ``zkv status --json`` prints for it, named; or why it did not answer."""
    rows = []
    for b in report.buses:
        row: dict[str, Any] = {"bus": b.name, "broker": b.broker, "ok": b.answer.ok, "ms": round(b.answer.at_ms, 3)}
        if b.answer.ok:
            row.update(b.answer.reply.fields if b.answer.reply is not None else {})
        else:
            row.update(code=b.answer.label, reason=b.answer.reason)
        rows.append(row)
    return rows


def status(fleet: Fleet, timeout: float, as_json: bool, wait_ranks: int, watch: bool, interval: float) -> None:
    from ..obs.status_view import watch_status

    if watch:
        if as_json:
            raise click.UsageError("--watch draws the table; for JSON, run zkv status --json repeatedly")
        sigterm_as_interrupt()
        bound = min(timeout, max(interval, 1.0))
        watch_status(lambda: status_rows(fleet.status(bound)), sys.stdout, interval, render=render_fleet_status)
        return
    rows = status_rows(fleet.status(timeout, wait_ranks))
    if as_json:
        for row in rows:
            click.echo(json.dumps(row, default=str))
    else:
        click.echo(render_fleet_status(rows))
    silent = [r["bus"] for r in rows if not r["ok"]]
    if silent:
        if not as_json:
            click.echo(
                f"zkv: error: {len(silent)} of {counted(len(rows), 'bus')} did not answer: {', '.join(silent)}",
                err=True,
            )
        sys.exit(1)


def _finish(call: Callable[[], FleetReport], as_json: bool) -> None:
    try:
        report = call()
    except FleetError as err:
        report = err.report
    record = report.to_json()
    click.echo(json.dumps(record, default=str) if as_json else render_fleet_report(record))
    if report.ok:
        return
    if as_json:
        sys.exit(1)
    failed = ", ".join(b.name for b in report.failed())
    stuck = report.not_resumable()
    what = f"fleet {report.op} failed on {failed}"
    if report.op == ControlOp.PAUSE:
        paused = [b.name for b in report.buses if b.answer.answer is Answer.OK]
        left = "left paused" if report.on_failure == "stay" else "resumed"
        what += f"; the buses it paused ({', '.join(paused)}) were {left}" if paused else "; no bus was paused by it"
        if stuck:
            names = ", ".join(b.name for b in stuck)
            what += f"; NOT RESUMED: {names} (the resume sent after the failed pause did not succeed: state unknown)"
        fail(what, "fix what the rows above name, then run the same command again")
    codes = {b.answer.code for b in report.failed()}
    if report.op == ControlOp.CLEAR and "not_paused" in codes:
        fail(what, "run zkv pause on the same buses first")
    fail(what, "run the same command again once the buses above answer: buses already there answer noop")


def pause(fleet: Fleet, timeout: float, as_json: bool, leave_paused: bool, allow_partial: bool = False) -> None:
    _finish(lambda: fleet.pause(timeout, on_failure="stay" if leave_paused else ControlOp.RESUME), as_json)
    replies = [(b.name, b.answer.reply) for b in (fleet.last_report.buses if fleet.last_report else ())]
    partial = [
        f"{name} ({r.ranks_acked} of {r.world} ranks)"
        for name, r in replies
        if isinstance(r, ControlReply) and r.world is not None and (r.ranks_acked or 0) < r.world
    ]
    if partial and not allow_partial:  # as for one bus (control.pause): not every rank of the world acked
        if not as_json:
            click.echo(
                f"zkv: error: the fleet is paused, but not by every rank: {', '.join(partial)}; check zkv status, "
                "or add --allow-partial to accept a pause of the live ranks",
                err=True,
            )
        sys.exit(1)


def clear(fleet: Fleet, timeout: float, as_json: bool, keep_cpu: bool) -> None:
    _finish(lambda: fleet.clear(keep_cpu=keep_cpu, timeout=timeout), as_json)


def resume(fleet: Fleet, timeout: float, as_json: bool, **kw: Any) -> None:
    layout = layout_change(kw)
    _finish(lambda: fleet.resume(layout or None, timeout), as_json)
