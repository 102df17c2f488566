"""The client commands of ``zkv``: ``status``, ``submit``, ``pause``,
``clear`` and ``resume``, each a request to the broker's frontend.

They print a one-line summary or ``--json``, and exit non-zero on any outcome
other than ok, with a line that says what to do.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import click

from ..net.endpoints import Endpoints
from ..wire.ids import decode_ids
from .options import curve_from, curve_options, fail, sigterm_as_interrupt

_DEFAULT = Endpoints.default


def _parse_ids(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11], by the wire's one parser."""
    try:
        return decode_ids(text, "ids")
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def client_options(fn: Callable) -> Callable:
    @click.option(
        "--broker",
        default=lambda: _DEFAULT().frontend,
        envvar="ZKV_BROKER",
        show_envvar=True,
        help="Broker frontend address.",
    )
    @click.option(
        "--timeout",
        type=float,
        default=30.0,
        show_default=True,
        envvar="ZKV_TIMEOUT",
        show_envvar=True,
        help="Seconds to wait for the outcome.",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print the reply as JSON.")
    @curve_options(server=True, client=True)
    @functools.wraps(fn)
    def wrapper(broker: str, timeout: float, as_json: bool, **kwargs: Any) -> None:
        from ..client.client import Client, ZkvError

        curve = curve_from(kwargs)
        try:
            client_cm = Client(broker, request_timeout=timeout, curve=curve)
        except ValueError as err:  # e.g. Curve without --curve-ranks: say so, no traceback
            fail(str(err))
        try:
            with client_cm as client:
                fn(client, timeout, as_json, **kwargs)
        except ZkvError as err:
            hints = {
                "no_reply": "start one with: zkv up, or point --broker / ZKV_BROKER at it",
                "unreachable": "start one with: zkv up, or point --broker / ZKV_BROKER at it",
                "not_paused": "run: zkv pause",
                "not_cleared": "run: zkv clear",
                "busy": "wait for the running operation, then retry",
            }
            if as_json:
                click.echo(json.dumps({"ok": False, "code": err.code, "reason": err.reason}))
                sys.exit(1)
            fail(err.reason, hints.get(err.code, ""))

    return wrapper


def _print_reply(reply: dict, as_json: bool, summary: str) -> None:
    if as_json:
        click.echo(json.dumps({k: v for k, v in reply.items() if k not in ("v", "kind", "req")}, default=str))
    else:
        click.echo(summary)


@click.command()
@client_options
@click.option("--wait-ranks", type=int, default=0, help="Wait until this many ranks are registered.")
@click.option("--watch", is_flag=True, help="Redraw the table until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between --watch redraws.",
)
def status(client: Any, timeout: float, as_json: bool, wait_ranks: int, watch: bool, interval: float) -> None:
    """Show the broker state, ranks, queue and counters as a table (--json: the reply)."""
    from ..obs.status_view import render_status, watch_status

    if watch:
        if as_json:
            raise click.UsageError("--watch draws the table; for JSON, run zkv status --json repeatedly")
        sigterm_as_interrupt()  # SIGTERM ends the watch like Ctrl-C (watch_status returns on KeyboardInterrupt)
        watch_status(lambda: client.status(timeout=min(timeout, max(interval, 1.0))), sys.stdout, interval)
        return
    st = client.status(timeout=timeout, wait_ranks=wait_ranks)
    _print_reply(st, as_json, render_status(st))


@click.command()
@click.argument("op", type=click.Choice(["swap-out", "swap-in", "fill", "checksum"]))
@click.option("--src", default="", help="Source block ids, e.g. 0-15,32.")
@click.option("--dst", default="", help="Destination block ids.")
@click.option("--tier", type=click.Choice(["gpu", "cpu"]), default=None, help="Tier for fill/checksum.")
@click.option("--seed", type=int, default=None, help="Seed for fill.")
@client_options
def submit(
    client: Any, timeout: float, as_json: bool, op: str, src: str, dst: str, tier: str | None, seed: int | None
) -> None:
    """Run one task on every rank and print its outcome."""
    out = client.run(
        op.replace("-", "_"), _parse_ids(src) or None, _parse_ids(dst) or None, timeout, tier=tier, seed=seed
    )
    if as_json:
        data = out.to_json()
        for r, res in out.per_rank.items():
            if "digests" in res:
                data["ranks"][str(r)]["digests"] = [d.hex() for d in res["digests"]]
        click.echo(json.dumps(data))
    else:
        click.echo(
            f"task {out.task}: {out.outcome}"
            + (f" ({out.reason})" if out.reason else "")
            + f"  {out.bytes} bytes moved in {out.elapsed_s * 1000:.2f} ms across {len(out.per_rank)} ranks"
        )
    if not out.ok:
        if not as_json:
            click.echo("zkv: error: the task did not succeed; see the reason above", err=True)
        sys.exit(1)


@click.command()
@client_options
def pause(client: Any, timeout: float, as_json: bool) -> None:
    """Stop dispatch and wait until every rank drained its tasks."""
    r = client.pause(timeout)
    _print_reply(
        r,
        as_json,
        f"paused: epoch {r['epoch']}, drained in {r['drain_ms']} ms" + (f" ({r['note']})" if r.get("noop") else ""),
    )


@click.command()
@client_options
@click.option("--keep-cpu", is_flag=True, help="Keep the CPU swap space; free only device caches.")
def clear(client: Any, timeout: float, as_json: bool, keep_cpu: bool) -> None:
    """Cancel held tasks and free every rank's caches (needs a paused bus)."""
    r = client.clear(keep_cpu=keep_cpu, timeout=timeout)
    _print_reply(
        r,
        as_json,
        f"cleared: epoch {r['epoch']}, generation {r['gen']}, {r['cancelled']} tasks cancelled, "
        f"{r['freed']} bytes freed" + (f" ({r['note']})" if r.get("noop") else ""),
    )


@click.command()
@client_options
@click.option("--gpu-blocks", type=int, default=None, help="New device blocks per rank (needs cleared caches).")
@click.option("--cpu-blocks", type=int, default=None, help="New CPU blocks per rank (needs cleared caches).")
def resume(client: Any, timeout: float, as_json: bool, gpu_blocks: int | None, cpu_blocks: int | None) -> None:
    """Reallocate caches if cleared and restart dispatch."""
    layout = {k: v for k, v in (("gpu_blocks", gpu_blocks), ("cpu_blocks", cpu_blocks)) if v is not None}
    r = client.resume(layout or None, timeout)
    _print_reply(
        r,
        as_json,
        f"running: epoch {r['epoch']}, generation {r['gen']}"
        + (f" ({r['note']})" if r.get("noop") else f", resumed in {r['resume_ms']} ms"),
    )
