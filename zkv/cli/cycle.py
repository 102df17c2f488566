"""``zkv cycle``: one RL cycle over a fleet of vLLM servers, each with its own
zkv bus, as one transaction (``zkv/cycle/``, docs/engine-vllm.md "A fleet of
vLLM servers").  Run the same command again (same id) to finish a cycle its
trainer left: a report that leaves something names that command.  ``--show``
prints what each engine says now.  Exit status: 0 committed, 1 rolled back,
2 incomplete (the report names what is left and the command that finishes
it), 3 refused (nothing was touched: an engine did not answer, or the new
weights did not check), 4 another cycle (or another driver) holds the fleet;
a usage error exits 2 with no report.  Options are checked before anything
is imported past the command line."""

from __future__ import annotations

import json
import re
import sys

import click

_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # zkv/cycle/label.py's ID, checked before importing it


def _per_server(default: str | None, each: tuple[tuple[str, str], ...], names: list[str], what: str) -> dict[str, str]:
    """Each server's path: ``--X-on NAME PATH`` over ``--X PATH`` (``{name}`` expands to the server's name)."""
    out = {n: default.replace("{name}", n) for n in names} if default is not None else {}
    for name, path in each:
        if name not in names:
            raise click.UsageError(f"{what}-on names {name!r}, not one of the servers ({', '.join(names)})")
        out[name] = path
    return out


@click.command()
@click.argument("cycle_id", required=False)
@click.option(
    "--server",
    "servers",
    nargs=3,
    multiple=True,
    required=True,
    metavar="NAME URL BUS",
    help="An engine: its name, its server (http://host:port) and its zkv bus (the broker's frontend). Repeat.",
)
@click.option("--reload", "reload_path", default=None, help="The new weights of every server ({name}: its name).")
@click.option("--reload-on", "reload_on", nargs=2, multiple=True, metavar="NAME PATH", help="One server's weights.")
@click.option("--rollback", "rollback_path", default=None, help="The weights to load back if the cycle fails.")
@click.option("--rollback-on", "rollback_on", nargs=2, multiple=True, metavar="NAME PATH", help="One server's.")
@click.option(
    "--unchanged", is_flag=True, help="Say the weights do not change: measured (vLLM's checksums), tiers kept if so."
)
@click.option("--mode", type=click.Choice(["abort", "wait", "keep"]), default="wait", show_default=True)
@click.option("--sleep", "use_sleep", is_flag=True, help="Sleep (level 0) and wake instead of pause and resume.")
@click.option(
    "--deadline",
    type=click.FloatRange(1.0, 3600.0),
    default=120.0,
    show_default=True,
    help="Seconds for the whole cycle, rollback included.",
)
@click.option(
    "--budget-on",
    "budget_on",
    nargs=2,
    multiple=True,
    metavar="NAME SECONDS",
    help="One server's budget for its steps before the commit (default: the deadline's forward part).",
)
@click.option("--budget", type=click.FloatRange(0.1, 3600.0), default=None, help="Every server's budget (seconds).")
@click.option("--label", default=None, help="The weight version label the engines carry after the cycle.")
@click.option("--no-stage", "no_stage", is_flag=True, help="Skip the checkpoint check before the pause.")
@click.option(
    "--record",
    "record",
    default=None,
    metavar="FILE",
    help="Where a commit writes the fleet's weight version; --show measures every server against it.",
)
@click.option(
    "--show",
    is_flag=True,
    help="Only print which weights each engine serves now and whether the fleet is on one version "
    "(no CYCLE_ID); touch nothing.",
)
@click.option("--metrics", is_flag=True, help="With --show: the same as Prometheus text.")
@click.option("--no-checksums", "no_checksums", is_flag=True, help="With --show: read no checksums (faster).")
@click.option("--json", "as_json", is_flag=True, help="The report as one JSON object.")
def cycle(
    cycle_id: str | None,
    servers: tuple[tuple[str, str, str], ...],
    reload_path: str | None,
    reload_on: tuple[tuple[str, str], ...],
    rollback_path: str | None,
    rollback_on: tuple[tuple[str, str], ...],
    unchanged: bool,
    mode: str,
    use_sleep: bool,
    deadline: float,
    budget_on: tuple[tuple[str, str], ...],
    budget: float | None,
    label: str | None,
    no_stage: bool,
    record: str | None,
    show: bool,
    metrics: bool,
    no_checksums: bool,
    as_json: bool,
) -> None:
    """Pause every engine and bus, load new weights, clear, resume: all or nothing."""
    names = [s[0] for s in servers]
    if len(set(names)) != len(names):
        raise click.UsageError(f"a server fleet needs engines with distinct names, got {names}")
    if show:
        if cycle_id is not None:
            raise click.UsageError("--show takes no CYCLE_ID: it shows every engine as it is now")
        _show(servers, record, as_json, metrics, not no_checksums)
        return
    if metrics or no_checksums:
        raise click.UsageError("--metrics and --no-checksums go with --show")
    if cycle_id is None:
        raise click.UsageError("name the cycle (CYCLE_ID), or --show")
    if not _ID.match(cycle_id):
        raise click.UsageError(f"a cycle id is 1-64 of [A-Za-z0-9._-], got {cycle_id!r}")
    reload = _per_server(reload_path, reload_on, names, "--reload")
    if set(reload) != set(names):
        missing = sorted(set(names) - set(reload))
        raise click.UsageError(f"name the new weights of {', '.join(missing)} (--reload PATH, --reload-on NAME PATH)")
    back = _per_server(rollback_path, rollback_on, names, "--rollback")
    budgets = dict.fromkeys(names, budget) if budget is not None else {}
    for name, seconds in budget_on:
        if name not in names:
            raise click.UsageError(f"--budget-on names {name!r}, not one of the servers ({', '.join(names)})")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            raise click.UsageError(f"--budget-on {name} {seconds!r}: a number of seconds") from None
    _run(
        cycle_id, servers, reload, back, unchanged, mode, use_sleep, deadline, budgets, label, no_stage, record, as_json
    )


def _run(
    cycle_id: str,
    servers: tuple[tuple[str, str, str], ...],
    reload: dict[str, str],
    back: dict[str, str],
    unchanged: bool,
    mode: str,
    use_sleep: bool,
    deadline: float,
    budgets: dict[str, float],
    label: str | None,
    no_stage: bool,
    record: str | None,
    as_json: bool,
) -> None:
    from ..cycle.runner import CycleBusy
    from ..cycle.servers import ReloadWeights, ServerFleet, ServerSpec, cycle_argv
    from ..cycle.terms import EXIT, EXIT_BUSY

    specs = [ServerSpec(*s) for s in servers]
    argv = cycle_argv(
        cycle_id, specs, reload, back, unchanged=unchanged, mode=mode, sleep=use_sleep, deadline=deadline,
        budgets=budgets, label=label, stage=not no_stage, record=record,
    )  # fmt: skip
    try:
        fleet = ServerFleet(specs, record=record)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    with fleet:
        try:
            report = fleet.cycle(
                cycle_id,
                {n: ReloadWeights(p) for n, p in reload.items()},
                rollback={n: ReloadWeights(p) for n, p in back.items()} or None,
                weights_changed=not unchanged,
                pause_mode=mode,
                sleep=use_sleep,
                deadline_s=deadline,
                budgets=budgets,
                new_label=label,
                stage=not no_stage,
                finish_argv=argv,
            )
        except CycleBusy as err:
            click.echo(f"zkv cycle: {err.reason}", err=True)
            sys.exit(EXIT_BUSY)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
    click.echo(json.dumps(report.to_json()) if as_json else report.describe())
    sys.exit(EXIT.get(report.outcome, 2))


def _show(
    servers: tuple[tuple[str, str, str], ...], record: str | None, as_json: bool, metrics: bool, checksums: bool
) -> None:
    from ..cycle.servers import ServerFleet, ServerSpec

    try:
        fleet = ServerFleet([ServerSpec(*s) for s in servers], record=record)
        with fleet:
            view = fleet.look(checksums=checksums, timeout=10.0)
    except ValueError as err:  # a record file that does not check
        raise click.UsageError(str(err)) from None
    if metrics:
        click.echo(view.metrics(), nl=False)
    elif as_json:
        click.echo(json.dumps(view.to_json()))
    else:
        click.echo(view.describe())
