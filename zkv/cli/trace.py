"""``zkv replay`` and ``zkv trace gen|check|diff``: the command-line face of
``zkv.trace`` (format, generators) and ``zkv.replay`` (driver, checker).

Exit status: 0 when everything held, 1 on any violation (each named with the
trace line numbers involved), 2 for a trace that cannot be read (the error
names the line) or bad options.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..wire.vocab import CLIENT_OPS
from .options import curve_from, curve_options, env_option, json_option, layout_from, layout_options, seconds_option


def _error(message: str, code: int = 2) -> None:
    click.echo(f"zkv: error: {message}", err=True)
    sys.exit(code)


def _load(path: str) -> Any:
    from ..trace import TraceError, load_trace

    try:
        return load_trace(path)
    except TraceError as err:
        _error(f"bad trace: {err}")
    except OSError as err:
        _error(f"cannot read {path}: {err.strerror}")


# --- zkv replay ------------------------------------------------------------------------------


@click.command()
@click.argument("trace_file", metavar="FILE", type=str)
@env_option(
    "--broker",
    default=None,
    envvar=["ZKV_BROKER", "ZKV_REPLAY_BROKER"],
    help="Replay against this running broker's frontend instead of an embedded local cluster "
    "(ZKV_REPLAY_BROKER is an older name for it).",
)
@env_option(
    "--speed",
    default="1",
    envvar="ZKV_REPLAY_SPEED",
    help="Timing: 1 = as recorded, 2.5 = 2.5x faster, max = as fast as possible.",
)
@env_option(
    "--record",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="ZKV_REPLAY_RECORD",
    help="Embedded cluster only: run its broker with --record FILE (a recording of this replay).",
)
@seconds_option(
    "--task-timeout", envvar="ZKV_REPLAY_TASK_TIMEOUT", help="Seconds a task may take before it ends 'timeout'."
)
@seconds_option("--op-timeout", envvar="ZKV_REPLAY_OP_TIMEOUT", help="Seconds a pause / clear / resume may take.")
@json_option("Print the report as JSON.")
@curve_options(server=True, client=True)
def replay(
    trace_file: str,
    broker: str | None,
    speed: str,
    record: str | None,
    task_timeout: float,
    op_timeout: float,
    as_json: bool,
    **curve_kw: Any,
) -> None:
    """Replay a trace FILE (- for stdin) and check what the bus did.

    Checks that every task got exactly one outcome, that outcomes match the
    trace's expectations, and that no rank copied while paused; reports
    counts per outcome, task latency, throughput and pause/clear/resume
    latency.  Exits 1 on any violation, naming the trace lines.
    """
    from ..client.client import ZkvError
    from ..harness.bus.local_replay import replay_embedded
    from ..replay import parse_speed
    from ..replay import replay as replay_running

    try:
        factor = parse_speed(speed)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--speed") from None
    if record and broker:
        raise click.UsageError(
            "--record needs the embedded cluster; to record against --broker, start that broker with --record"
        )
    curve = curve_from(curve_kw)
    if curve is not None and not broker:
        raise click.UsageError(
            "--curve-* options are for --broker: the embedded cluster listens on private ipc:// sockets"
        )
    if curve is not None and not curve.ranks_dir:
        raise click.UsageError("a Curve client needs --curve-ranks: the rank public keys its result socket lets in")
    if broker:
        from .reach import check_broker

        check_broker(broker, curve)
    trace = _load(trace_file)
    bar: Any = None
    kwargs: dict[str, Any] = {"speed": factor, "task_timeout": task_timeout, "op_timeout": op_timeout}
    if sys.stderr.isatty() and trace.ops:

        def progress(n: int) -> None:  # the bar starts with the first record, not with the cluster
            nonlocal bar
            if bar is None:
                bar = click.progressbar(length=len(trace.ops), label="replay", file=sys.stderr)
                bar.__enter__()
            bar.update(n)

        kwargs["progress"] = progress
    try:
        if broker:
            report = replay_running(trace, broker, curve=curve, **kwargs)
            report.target = broker
        else:
            report = replay_embedded(trace, record=record, **kwargs)
    except ZkvError as err:
        _error(f"{err.reason}", 2)
    except (TimeoutError, RuntimeError) as err:
        _error(f"the embedded cluster did not start: {err}", 2)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    _say_report(report, as_json)
    if not report.ok:
        sys.exit(1)


def _say_report(report: Any, as_json: bool) -> None:
    """The report (text or JSON), then what stopping an embedded cluster met, on stderr:
    it comes after the replay and is no part of its verdict."""
    from ..replay import format_report

    click.echo(json.dumps(report.to_json()) if as_json else format_report(report))
    if report.teardown:
        click.echo(f"zkv replay: stopping the embedded cluster: {report.teardown}", err=True)


# --- zkv trace ...  --------------------------------------------------------------------------


@click.group()
def trace() -> None:
    """Make, check and compare traces (see docs/traces.md)."""


@trace.command("gen")
@click.argument("shape", type=click.Choice(["steady", "bursty", "rl-cycle"]))
@click.option("--tasks", type=click.IntRange(min=0), default=100, show_default=True, help="Tasks in the trace.")
@click.option(
    "--seed",
    type=click.IntRange(0, 2**53 - 1),
    default=0,
    show_default=True,
    help="Random seed (same seed, same trace).",
)
@click.option(
    "--world-size", type=click.IntRange(min=1), default=2, show_default=True, help="Ranks the trace is made for."
)
@layout_options
@click.option(
    "--rate",
    type=click.FloatRange(0, min_open=True),
    default=200.0,
    show_default=True,
    help="steady / rl-cycle: tasks per second.",
)
@click.option(
    "--clients", type=click.IntRange(min=1), default=None, help="Submitting clients (steady/rl-cycle 1, bursty 2)."
)
@click.option("--burst", type=click.IntRange(min=1), default=16, show_default=True, help="bursty: tasks per burst.")
@click.option(
    "--gap", type=click.FloatRange(0), default=0.05, show_default=True, help="bursty: seconds between bursts."
)
@click.option(
    "--every",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="rl-cycle: running tasks between pause/clear/resume cycles.",
)
@click.option(
    "--held",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="rl-cycle: tasks arriving while paused, and again while cleared.",
)
@click.option("--max-blocks", type=click.IntRange(min=1), default=8, show_default=True, help="Most blocks per task.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="-",
    show_default=True,
    help="File to write (- for stdout).",
)
def gen(
    shape: str,
    tasks: int,
    seed: int,
    world_size: int,
    rate: float,
    clients: int | None,
    burst: int,
    gap: float,
    every: int,
    held: int,
    max_blocks: int,
    output: str,
    **layout_kw: Any,
) -> None:
    """Write a synthetic trace of SHAPE: steady, bursty or rl-cycle."""
    from ..trace import dump_records, generate
    from ..wire.protocol import ProtocolError

    layout = layout_from(layout_kw)
    try:
        records = list(
            generate(
                shape,
                tasks,
                seed,
                world=world_size,
                layout=layout,
                rate=rate,
                clients=clients,
                burst=burst,
                gap=gap,
                every=every,
                held=held,
                max_blocks=max_blocks,
            )
        )
    except (ValueError, ProtocolError) as err:
        raise click.UsageError(str(err)) from None
    with click.open_file(output, "w") as out:
        dump_records(records, out)


@trace.command("check")
@click.argument("trace_file", metavar="FILE")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def check_cmd(trace_file: str, as_json: bool) -> None:
    """Validate a trace FILE; for a recording, check its books too.

    A recording (a trace with outcome records) must hold exactly one outcome
    record per submit: exit 1 naming the lines otherwise.
    """
    from ..trace import check_recording

    t = _load(trace_file)
    recorded = any(s.recorded for s in t.tasks.values())
    problems = check_recording(t) if recorded else []
    ops = {ev: sum(1 for op in t.ops if op.ev == ev) for ev in ("submit", *(op.value for op in CLIENT_OPS))}
    summary = {
        "ok": not problems,
        "source": t.source,
        "world": t.world,
        "layout": t.layout.to_wire() if t.layout else None,
        "segments": t.segments,
        "ops": ops,
        "duration_s": round(t.ops[-1].t - t.ops[0].t, 6) if t.ops else 0.0,
        "expectations": sum(len(s.expects) for s in t.tasks.values()),
        "recording": recorded,
        "problems": problems,
    }
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(
            f"{t.source}: valid trace v1, world {t.world}, {ops['submit']} submits, {ops['pause']} pause, "
            f"{ops['clear']} clear, {ops['resume']} resume over {summary['duration_s']} s"
            + (f", {t.segments} sessions" if t.segments > 1 else "")
        )
        for p in problems:
            click.echo(f"  line {', '.join(map(str, p['lines']))}: {p['message']}")
    if problems:
        sys.exit(1)


@trace.command("diff")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--json", "as_json", is_flag=True, help="Print the differences as JSON.")
def diff_cmd(a: str, b: str, as_json: bool) -> None:
    """Compare the recorded outcome sequence of every task in two traces.

    Clients are matched by the tasks they submit (recordings name them by ZMQ
    identity); exit 1 if any task's outcomes differ.
    """
    from ..trace import compare_outcomes

    ta, tb = _load(a), _load(b)
    diffs = compare_outcomes(ta, tb)
    if as_json:
        click.echo(json.dumps({"same": not diffs, "tasks": len(ta.tasks), "differences": diffs}))
    elif diffs:
        click.echo(f"{len(diffs)} difference(s):")
        for d in diffs:
            click.echo(f"  {d['message']}")
    else:
        click.echo(f"same outcomes for all {len(ta.tasks)} tasks")
    if diffs:
        sys.exit(1)


def draw_plot(draw: Any, *args: Any) -> str:
    """Run a plot function, turning a missing matplotlib or an unreadable
    input into one line that says what to do (exit 2)."""
    try:
        return draw(*args)
    except ImportError:
        from ..obs.plots import MISSING

        _error(MISSING)
    except OSError as err:
        _error(f"{err.filename or args[0]}: {err.strerror or err}")
    except ValueError as err:
        _error(str(err))
    raise AssertionError("unreachable")


@trace.command("plot")
@click.argument("trace_file", metavar="TRACE")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="PNG file to write.")
def plot_cmd(trace_file: str, output: str) -> None:
    """Draw a recording TRACE (zkv broker --record): task latency over time,
    outcomes coloured, pause / clear / resume shaded (needs matplotlib)."""
    from ..obs.plots import plot_trace, require_matplotlib

    draw_plot(require_matplotlib)

    click.echo(f"wrote {draw_plot(plot_trace, trace_file, output)}")
