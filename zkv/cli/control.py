"""The client commands of ``zkv``: ``status``, ``pause``, ``clear`` and
``resume`` (``submit`` is ``submit.py``), each a request to the broker's
frontend, and the options every client command shares.

They print a one-line summary or ``--json``, and exit non-zero on any outcome
other than ok, with a line that says what to do.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import TYPE_CHECKING, Any, Callable

import click

from ..net.endpoints import Endpoints
from ..wire.bounds import MAX_WORLD
from ..wire.errors import ZkvError
from . import fleet as fleet_cli
from .options import (
    curve_from,
    curve_options,
    env_option,
    fail,
    json_option,
    layout_change,
    layout_change_options,
    resume_flags,
    seconds_option,
    sigterm_as_interrupt,
)
from .reach import check_broker, hint

if TYPE_CHECKING:
    from ..wire.replies import ControlReply

_DEFAULT = Endpoints.default


def client_options(fn: Callable) -> Callable:
    """The options of a command to one broker (``submit``)."""
    return _client_options(fn, None)


def fleet_options(handler: Callable) -> Callable[[Callable], Callable]:
    """The options of a command that also drives a fleet: several ``--broker``
    or ``--fleet FILE`` run ``handler`` (``cli/fleet.py``) over every bus."""
    return lambda fn: _client_options(fn, handler)


def _client_options(fn: Callable, fleet_handler: Callable | None) -> Callable:
    broker_help = "Broker frontend address (ipc://PATH or tcp://HOST:PORT)."
    if fleet_handler is not None:
        broker_help += " Give it several times to act on every bus at once (a fleet)."

    @env_option(
        "--broker",
        default=(lambda: (_DEFAULT().frontend,)) if fleet_handler else (lambda: _DEFAULT().frontend),
        show_default=False,
        multiple=fleet_handler is not None,
        envvar="ZKV_BROKER",
        help=broker_help,
    )
    @seconds_option("--timeout", envvar="ZKV_TIMEOUT", help="Seconds to wait for the outcome.")
    @json_option("Print the reply as JSON.")
    @curve_options(server=True, client=True)
    @functools.wraps(fn)
    def wrapper(broker: Any, timeout: float, as_json: bool, **kwargs: Any) -> None:
        from ..client.client import Client, ZkvError

        if fleet_handler is not None:
            fleet_file = kwargs.pop("fleet_file")
            if fleet_file or len(broker) > 1:
                from .fleet import run_fleet

                run_fleet(fleet_handler, broker, fleet_file, timeout, as_json, kwargs)
                return
            broker = broker[0]
        curve = curve_from(kwargs)
        if kwargs.get("watch") or kwargs.get("wait_ranks"):  # waits for a bus still coming up: only the address
            check_broker(broker, curve, probe=False)
        else:
            check_broker(broker, curve, as_json=as_json)
        try:
            client_cm = Client(broker, request_timeout=timeout, curve=curve)
        except ValueError as err:  # e.g. Curve without --curve-ranks: say so, no traceback
            fail(str(err))
        try:
            with client_cm as client:
                fn(client, timeout, as_json, **kwargs)
        except ZkvError as err:
            if as_json:
                click.echo(json.dumps({"ok": False, "code": err.code, "reason": err.reason}))
                sys.exit(1)
            fail(err.reason, hint(err.code, broker, curve, err.reason))

    if fleet_handler is None:
        return wrapper
    return env_option(
        "--fleet",
        "fleet_file",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        envvar="ZKV_FLEET",
        help="A fleet file (JSON: each bus's name, broker and Curve keys): act on every bus at once.",
    )(wrapper)


def _print_reply(reply: dict, as_json: bool, summary: str) -> None:
    """``--json``: the reply's map as the broker sent it (``as_dict()``), less ``v``, ``kind``, ``req``."""
    if as_json:
        click.echo(json.dumps({k: v for k, v in reply.items() if k not in ("v", "kind", "req")}, default=str))
    else:
        click.echo(summary)


@click.command()
@fleet_options(fleet_cli.status)
@env_option(
    "--wait-ranks",
    type=click.IntRange(0, MAX_WORLD),
    default=0,
    show_default=False,
    envvar="ZKV_STATUS_WAIT_RANKS",
    help="Wait until this many ranks are registered.",
)
@env_option("--watch", is_flag=True, envvar="ZKV_STATUS_WATCH", help="Redraw the table until Ctrl-C.")
@env_option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    envvar="ZKV_STATUS_INTERVAL",
    help="Seconds between --watch redraws.",
)
def status(client: Any, timeout: float, as_json: bool, wait_ranks: int, watch: bool, interval: float) -> None:
    """Show the broker state, ranks, queue and counters as a table (--json: the reply)."""
    from ..obs.status_view import render_status, watch_status

    if watch:
        if as_json:
            raise click.UsageError("--watch draws the table; for JSON, run zkv status --json repeatedly")
        sigterm_as_interrupt()  # SIGTERM ends the watch like Ctrl-C (watch_status returns on KeyboardInterrupt)
        watch_status(lambda: client.status(timeout=min(timeout, max(interval, 1.0))).as_dict(), sys.stdout, interval)
        return
    st = client.status(timeout=timeout, wait_ranks=wait_ranks).as_dict()
    _print_reply(st, as_json, render_status(st))


@click.command()
@fleet_options(fleet_cli.pause)
@env_option(
    "--leave-paused",
    is_flag=True,
    envvar="ZKV_PAUSE_LEAVE_PAUSED",
    help="Several buses: a failed pause leaves the buses it paused paused (default: resumes them).",
)
@env_option(
    "--allow-partial",
    is_flag=True,
    envvar="ZKV_PAUSE_ALLOW_PARTIAL",
    help="Exit 0 when the pause completed without some ranks of the world (dead or not registered); "
    "by default that exits 1.",
)
def pause(client: Any, timeout: float, as_json: bool, leave_paused: bool, allow_partial: bool) -> None:
    """Stop dispatch and wait until every rank drained its tasks (every bus, with several).

    Exits 1 when not every rank of the world acknowledged (a rank dead or
    never started: the pause completed without it), unless --allow-partial."""
    del leave_paused  # one bus: the broker itself runs a failed pause again (docs/protocol.md §8.3)
    r = client.pause(timeout)
    st = client.status(timeout=timeout)
    world = st.world
    # a noop (already paused): every live rank holds the pause (a rank learns it when it registers)
    held = [x.rank for x in st.ranks if x.alive and (r.noop or x.acked_epoch == r.epoch)]
    missing = sorted(set(range(world)) - set(held))
    acked = world - len(missing)
    # Counted here for a no-op too (its reply carries neither): what --json readers check.
    counted = {"world": world, "ranks_acked": acked, "ranks_missing": missing}
    _print_reply(
        {**r.as_dict(), **counted},
        as_json,
        f"paused: epoch {r.epoch}, {acked} of {world} ranks "
        + ("hold it" if r.noop else "acked")
        + f", drained in {r.elapsed_ms} ms"
        + (f" ({r.note})" if r.noop else "")
        + (f" (ranks {missing} did not: dead or not registered)" if missing else ""),
    )
    if missing and not allow_partial:
        click.echo(  # stderr: --json's stdout stays one object
            f"zkv: error: only {acked} of {world} ranks "
            + ("hold the pause" if r.noop else "acknowledged the pause")
            + f": the bus is paused without ranks {missing} (they learn it when they register); check zkv "
            "status, or add --allow-partial to accept a pause of the live ranks",
            err=True,
        )
        sys.exit(1)


@click.command()
@fleet_options(fleet_cli.clear)
@env_option(
    "--keep-cpu",
    is_flag=True,
    envvar="ZKV_CLEAR_KEEP_CPU",
    help="Keep the CPU swap space; free only device caches.",
)
def clear(client: Any, timeout: float, as_json: bool, keep_cpu: bool) -> None:
    """Cancel held tasks and free every rank's caches (needs a paused bus)."""
    from ..obs.status_view import human_bytes

    r = client.clear(keep_cpu=keep_cpu, timeout=timeout)
    _print_reply(
        r.as_dict(),
        as_json,
        f"cleared: epoch {r.epoch}, generation {r.gen}, {r.cancelled} tasks cancelled, "
        f"{human_bytes(r.freed)} freed" + (f" ({r.note})" if r.noop else ""),
    )


@click.command()
@fleet_options(fleet_cli.resume)
@layout_change_options
def resume(client: Any, timeout: float, as_json: bool, **kw: Any) -> None:
    """Reallocate caches if cleared and restart dispatch.  After a clear, the layout
    options change the bus's layout (unset ones stay): bring a bus to a new engine's."""
    layout = layout_change(kw)
    try:
        r = client.resume(layout or None, timeout)
    except ZkvError as err:
        if err.code != "not_cleared" or as_json:
            raise
        asked = resume_flags(layout)  # the broker's reason names what to run first: said once
        fail(f"{err.reason}, then zkv resume {asked} ({asked} was not applied)")
    _print_reply(
        r.as_dict(),
        as_json,
        f"running: epoch {r.epoch}, generation {r.gen}"
        + (f" ({r.note})" if r.noop else f", resumed in {r.elapsed_ms} ms")
        + _cpu_tier_said(r),
    )
    if r.cpu_kept is False and not as_json:
        click.echo("zkv: note: the CPU blocks kept by the clear are gone; a swap-in of them fails lost_block", err=True)


def _cpu_tier_said(r: ControlReply) -> str:
    """What a resume after ``clear --keep-cpu`` did with the CPU tier (its ``cpu_kept``)."""
    if r.cpu_kept is True:
        return f"; CPU blocks kept (CPU generation {r.cpu_gen})"
    if r.cpu_kept is False:
        why = r.note or "the CPU tier could not be kept"
        return f"; CPU blocks NOT kept: {why} (now CPU generation {r.cpu_gen})"
    return ""
