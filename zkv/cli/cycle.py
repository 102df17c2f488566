"""``zkv cycle``: one RL cycle over a fleet of vLLM servers, each with its own
zkv bus, as one transaction (``engines/vllm/server_cycle.py``,
docs/engine-vllm.md "A fleet of vLLM servers").  Run the same command again
(same id) to finish a cycle its trainer left; ``--show`` prints what each
engine says now.  Exit status: 0 committed, 1 rolled back, 2 incomplete
(the report names what is left and the command that finishes it), 3 refused
(an engine did not answer: nothing was touched), 4 another cycle is in progress."""

from __future__ import annotations

import json
import shlex
import sys

import click

_EXIT = {"committed": 0, "rolled_back": 1, "incomplete": 2, "refused": 3}


@click.command()
@click.argument("cycle_id")
@click.option(
    "--server",
    "servers",
    nargs=3,
    multiple=True,
    required=True,
    metavar="NAME URL BUS",
    help="An engine: its name, its server (http://host:port) and its zkv bus (the broker's frontend). Repeat.",
)
@click.option("--reload", "reload_path", default=None, help="The new weights: vLLM's reload_weights of this path.")
@click.option("--rollback", "rollback_path", default=None, help="The weights to load back if the cycle fails.")
@click.option(
    "--unchanged", is_flag=True, help="Say the weights do not change: measured (vLLM's checksums), tiers kept if so."
)
@click.option("--mode", type=click.Choice(["abort", "wait", "keep"]), default="wait", show_default=True)
@click.option("--sleep", "use_sleep", is_flag=True, help="Sleep (level 0) and wake instead of pause and resume.")
@click.option("--deadline", type=click.FloatRange(1.0, 3600.0), default=120.0, show_default=True, help="Seconds.")
@click.option("--label", default=None, help="The weight version label the engines carry after the cycle.")
@click.option("--show", is_flag=True, help="Only print each engine's label and pause state; touch nothing.")
@click.option("--json", "as_json", is_flag=True, help="The report as one JSON object.")
def cycle(
    cycle_id: str,
    servers: tuple[tuple[str, str, str], ...],
    reload_path: str | None,
    rollback_path: str | None,
    unchanged: bool,
    mode: str,
    use_sleep: bool,
    deadline: float,
    label: str | None,
    show: bool,
    as_json: bool,
) -> None:
    """Pause every engine and bus, clear, load new weights, resume: all or nothing."""
    from ..engines.vllm.server_cycle import CycleBusy, ReloadWeights, ServerFleet, ServerSpec

    again = "zkv " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        fleet = ServerFleet([ServerSpec(*s) for s in servers], finish_hint=again)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    with fleet:
        if show:
            click.echo(json.dumps(fleet.states(), indent=None if as_json else 2))
            return
        if reload_path is None:
            raise click.UsageError("name the new weights (--reload PATH), or --show")
        try:
            report = fleet.cycle(
                cycle_id,
                ReloadWeights(reload_path),
                rollback=ReloadWeights(rollback_path) if rollback_path else None,
                weights_changed=not unchanged,
                pause_mode=mode,
                sleep=use_sleep,
                deadline_s=deadline,
                new_label=label,
            )
        except CycleBusy as err:
            click.echo(f"zkv cycle: {err.reason}", err=True)
            sys.exit(4)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
    click.echo(json.dumps(report.to_json()) if as_json else report.describe())
    sys.exit(_EXIT.get(report.outcome, 2))
