"""``zkv up`` as a supervisor and ``zkv down``: a rank that exits is started
again, the processes die with ``zkv up`` (``harness/bus/lifeline.py``), and
another terminal finds and stops a running ``zkv up`` by the lock it holds in
its runtime directory."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click

from .options import env_option, fail, runtime_dir_option

RESTARTS_PER_MINUTE = 5  # a rank that exits more often than this is not restarted again


def supervise(cluster: Any) -> None:
    """Until Ctrl-C or SIGTERM (``zkv down``): a rank that exits is started again
    (on the bus's current layout, which a resume may have changed since the start
    flags: its CPU tier file of that layout is mapped again, blocks kept), unless it
    exits too often; a rank a standby took over is started again as that worker's
    standby (on the same layout); the broker or an engine exiting stops all."""
    restarts: dict[int, list[float]] = {}
    while True:
        pid, status = os.wait()  # blocks until a child exits (or Ctrl-C / SIGTERM)
        code = os.waitstatus_to_exitcode(status)
        rank = next((r for r, p in cluster.workers.items() if p.pid == pid), None)
        if rank is None:
            if cluster.broker is not None and pid == cluster.broker.pid:
                fail(f"the broker exited with code {code}", "see its log above")
            engines = {e.proc.pid: r for r, e in getattr(cluster, "engines", {}).items()}
            if pid in engines:
                fail(f"engine {engines[pid]} exited with code {code}", "see its log above")
            continue  # a child that is no longer ours (a rank already restarted)
        cluster.workers[rank].returncode = code  # reaped here: Popen must not wait for it again
        serving = cluster.served_elsewhere(rank)
        if serving is not None:
            # A standby (zkv worker --standby) took the rank over: the bus is served. The
            # worker started again waits as the new standby, instead of being refused.
            click.echo(
                f"zkv up: rank {rank} exited with code {code}; pid {serving} serves it now (a standby took "
                "over): starting it again as that worker's standby"
            )
            _restart(cluster, rank, ["--standby"])
            continue
        now = time.monotonic()
        recent = [t for t in restarts.get(rank, []) if now - t < 60] + [now]
        restarts[rank] = recent
        if len(recent) > RESTARTS_PER_MINUTE:
            fail(f"rank {rank} exited {len(recent)} times within a minute (last with code {code})", "see its log above")
        click.echo(f"zkv up: rank {rank} exited with code {code}; starting it again")
        _restart(cluster, rank)


LAYOUT_ASK_S = 5.0  # how long a restart waits for the broker to name the bus's layout


def _restart(cluster: Any, rank: int, extra: list[str] | None = None) -> None:
    """Start ``rank``'s worker again.  One attached to an engine has its engine's layout
    (``--adopt-layout`` is refused there).  One of zkv's own memory starts on the layout
    the bus holds now, which a resume may have changed since the start flags: that
    layout names the CPU tier file the rank left (``zkv-tier-<bus>-r<R>-<layout>``), so
    the worker maps it again and the bus keeps its CPU blocks; started on its flags
    instead, it would open a tier of the old layout and allocate anew at the resume.
    ``--adopt-layout`` covers a layout that changes again before it registers."""
    extra = list(extra or [])
    if getattr(cluster, "engines", None) is not None:
        cluster.start_worker(rank, extra)
        return
    layout = _bus_layout(cluster)
    if layout is None:
        click.echo(
            f"zkv up: the broker did not name the bus's layout within {LAYOUT_ASK_S:g} s: rank {rank} starts on "
            "its start flags and takes the bus's layout at its registration (its CPU tier is then allocated anew "
            "if the layout changed)"
        )
    cluster.start_worker(rank, ["--adopt-layout", *extra], layout=layout)


def _bus_layout(cluster: Any) -> Any:
    """The layout the bus holds now (None: the broker did not answer in time, or holds none)."""
    from ..client.client import ZkvError

    try:
        with cluster.client(request_timeout=LAYOUT_ASK_S) as client:
            return client.status(timeout=LAYOUT_ASK_S).layout
    except ZkvError:
        return None


def hold_up_lock(directory: Path) -> Any:
    """``up.lock`` in the runtime directory, by which ``zkv down`` finds this process."""
    from ..harness.bus.lifeline import UpLock

    try:
        return UpLock(directory)
    except BlockingIOError:
        fail(f"another zkv up holds {directory}", f"stop it with: zkv down --runtime-dir {directory}")


@click.command()
@runtime_dir_option("The runtime directory of the zkv up to stop (default: the one zkv up uses by default).")
@env_option(
    "--timeout",
    type=click.FloatRange(0, 3600, min_open=True),
    default=30.0,
    envvar="ZKV_TIMEOUT",
    help="Seconds to wait for it to stop.",
)
def down(runtime_dir: str | None, timeout: float) -> None:
    """Stop the zkv up running in a runtime directory (as Ctrl-C does): its broker, ranks and engines."""
    from ..harness.bus import lifeline
    from ..net.endpoints import runtime_dir as default_runtime_dir

    where = runtime_dir or str(default_runtime_dir())
    pid = lifeline.running(where)
    if pid is None:
        fail(f"no zkv up is running in {where}", "pass the --runtime-dir it was started with")
    if not lifeline.stop(pid, timeout):
        fail(f"zkv up (pid {pid}) did not stop within {timeout:g} s", f"kill -9 {pid} stops its processes too")
    click.echo(f"zkv down: stopped zkv up (pid {pid}) in {where}")
