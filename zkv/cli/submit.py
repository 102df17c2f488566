"""``zkv submit``: one task on every rank, its outcome printed (each rank's
digests for a checksum), exit 1 unless it ended ok; Ctrl-C cancels it while
the broker still holds it queued."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Callable

import click

from ..wire.bounds import MAX_SAFE_INT
from ..wire.errors import ZkvError
from ..wire.ids import decode_ids
from ..wire.vocab import BusState, Outcome, TaskState, Tier
from .control import client_options
from .options import env_option

if TYPE_CHECKING:
    from ..wire.replies import StatusReply


def _parse_ids(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11], by the wire's one parser."""
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        if dash and lo.strip().isdigit() and hi.strip().isdigit() and int(hi) < int(lo):
            raise click.BadParameter(f"{part}: the end is before the start (write {hi.strip()}-{lo.strip()})")
    try:
        return decode_ids(text, "ids")
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def _ids_option(option: str, envvar: str, help: str) -> Callable:
    """A block-id list option (``0-15,32``; none by default), read by ``_parse_ids``."""
    return env_option(
        option,
        default="",
        show_default=False,
        envvar=envvar,
        callback=lambda ctx, param, value: _parse_ids(value),
        help=help,
    )


def _why_not_now(st: StatusReply) -> str:
    """What keeps a task submitted now from running at once, from a status reply ('' when nothing)."""
    state = st.state
    if state is BusState.PAUSED:
        return "the bus is paused: tasks are held until zkv resume"
    if state is BusState.CLEARED:
        return "the bus is cleared: the broker rejects tasks until zkv resume reallocates the caches"
    if state not in (None, BusState.RUNNING):
        return f"the bus is {state}: the task waits until that op completes"
    alive, world = len(st.alive_ranks), st.world
    if alive < world:
        return f"{alive} of {world} ranks answer: a task runs on every rank, so it waits for the missing ones"
    return ""


@click.command()
@click.argument("op", type=click.Choice(["swap-out", "swap-in", "fill", "checksum", "spill", "load"]))
@_ids_option(
    "--src",
    "ZKV_SUBMIT_SRC",
    "Source block ids, e.g. 0-15,32: swap-out reads these GPU blocks, swap-in and spill these CPU blocks, "
    "load these disk blocks, checksum these blocks of --tier.",
)
@_ids_option(
    "--dst",
    "ZKV_SUBMIT_DST",
    "Destination block ids: swap-out and load write these CPU blocks, swap-in these GPU blocks, "
    "spill these disk blocks, fill these blocks of --tier.",
)
@env_option(
    "--tier",
    type=click.Choice([t.value for t in Tier]),
    default=None,
    envvar="ZKV_SUBMIT_TIER",
    help="Tier for fill (gpu, cpu) and checksum (gpu, cpu, disk: ranks started with --disk-dir).",
)
@env_option(
    "--seed",
    type=click.IntRange(0, MAX_SAFE_INT),
    default=None,
    envvar="ZKV_SUBMIT_SEED",
    help="Seed of the bytes fill writes.",
)
@client_options
def submit(
    client: Any,
    timeout: float,
    as_json: bool,
    op: str,
    src: list[int],
    dst: list[int],
    tier: str | None,
    seed: int | None,
) -> None:
    """Run one task on every rank and print its outcome.

    swap-out --src GPU --dst CPU, swap-in --src CPU --dst GPU, spill --src CPU
    --dst DISK, load --src DISK --dst CPU, fill --dst IDS [--tier gpu|cpu]
    [--seed N], checksum --src IDS [--tier gpu|cpu|disk] (prints each rank's
    digests)."""
    from ..obs.status_view import human_bytes

    src_ids, dst_ids = src or None, dst or None  # parsed by the options' callback, before the broker is asked
    st = client.status(timeout=timeout)  # the broker answers first, or the error names it, not the ranks
    waits = _why_not_now(st)
    if waits and not as_json:
        click.echo(f"zkv: note: {waits}", err=True)
    out = _run_or_cancel(client, op.replace("-", "_"), src_ids, dst_ids, timeout, tier, seed)
    digests = {r: [d.hex() for d in res["digests"]] for r, res in sorted(out.per_rank.items()) if "digests" in res}
    if as_json:
        data = out.to_json()
        for r, hexes in digests.items():
            data["ranks"][str(r)]["digests"] = hexes
        click.echo(json.dumps(data))
    else:
        reason = out.reason
        if out.outcome == Outcome.TIMEOUT and out.ran is False:
            reason = f"still queued after {timeout:g} s, the broker dropped it: it never ran" + (
                f" ({waits})" if waits else ""
            )
        elif out.outcome == Outcome.TIMEOUT and not out.per_rank:
            reason = f"no rank answered within {timeout:g} s: " + (waits or "see zkv status")
        click.echo(
            f"task {out.task}: {out.outcome}"
            + (f" ({reason})" if reason else "")
            + f"  {human_bytes(out.bytes)} moved in {out.elapsed_s * 1000:.2f} ms across {len(out.per_rank)} ranks"
        )
        for r, hexes in digests.items():
            click.echo(f"  rank {r} digests: {' '.join(hexes)}")
    if not out.ok:
        if not as_json:
            click.echo("zkv: error: the task did not succeed; see the reason above", err=True)
        sys.exit(1)


def _run_or_cancel(client: Any, op: str, src: Any, dst: Any, timeout: float, tier: str | None, seed: int | None) -> Any:
    """The task's outcome; Ctrl-C cancels it when the broker still holds it queued."""
    task = client.submit(op, src, dst, timeout, tier=tier, seed=seed)
    try:
        return client.wait(task)
    except KeyboardInterrupt:
        try:
            answer = client.cancel(task, timeout=min(timeout, 5.0))
            cancelled, state = answer.cancelled, answer.state
        except ZkvError:
            cancelled, state = False, TaskState.UNKNOWN
        if cancelled:
            click.echo(f"zkv: task {task} {Outcome.CANCELLED} before it was dispatched: it never ran", err=True)
        else:
            click.echo(f"zkv: task {task} was {state} when Ctrl-C came: it runs to its own outcome", err=True)
        sys.exit(130)
