"""``zkv up``: a whole bus on this machine (a broker and its rank workers,
optionally engine processes that own the KV tensors, and a demo workload), as
child processes that stop together.  The processes themselves are the
commands of ``commands.py``.

A runtime directory that holds a broker state file is a bus that ran there
before: ``zkv up`` says what it restores, starts the ranks on the restored
layout, and refuses flags that disagree with it (``--fresh`` starts from
nothing) instead of letting the broker resize the ranks behind them."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..net.endpoints import Endpoints
from ..obs.status_view import counted
from ..wire.bounds import MAX_WORLD
from ..wire.vocab import BusState
from .options import (
    disk_options,
    env_option,
    fail,
    layout_from,
    layout_options,
    metrics_options,
    record_option,
    runtime_dir_option,
    sigterm_as_interrupt,
    tier_options,
)
from .supervise import hold_up_lock, supervise

if TYPE_CHECKING:
    from ..wire.replies import StatusReply

_LAYOUT_FIELDS = ("layers", "gpu_blocks", "cpu_blocks", "block_size", "kv_heads", "head_dim", "dtype")


def _explicit(names: tuple[str, ...]) -> set[str]:
    """The parameters the operator set (on the command line or in the environment)."""
    ctx = click.get_current_context()
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return {name for name in names if ctx.get_parameter_source(name) in given}


def _restore(path: Path, fresh: bool, ranks: int, kw: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
    """The snapshot the broker will restore (None: it starts afresh) and the
    world size; fills the layout options the operator left unset from it."""
    from .state import describe, load_state

    if fresh:
        if path.exists():
            path.replace(path.with_name(path.name + ".old"))
            click.echo(f"zkv up: --fresh: moved {path} aside to {path.name}.old; starting from nothing")
        return None, ranks
    try:
        loaded = load_state(path)
    except ValueError as err:
        fail(str(err), "or add --fresh to move it aside and start from nothing")
    if loaded is None:
        return None, ranks
    snap = loaded[1]
    explicit = _explicit(("ranks", *_LAYOUT_FIELDS))
    restored = dict(snap.get("layout") or {})
    conflicts = [
        f"--{name.replace('_', '-')} {kw[name]} (restored: {restored[name]})"
        for name in _LAYOUT_FIELDS
        if name in explicit and name in restored and kw[name] != restored[name]
    ]
    if "ranks" in explicit and ranks != snap["world"]:
        conflicts.insert(0, f"--ranks {ranks} (restored: {snap['world']})")
    if conflicts:
        fail(
            f"{path} restores a bus {describe(snap)}; these flags disagree with it: {', '.join(conflicts)}",
            "drop them to come up as restored, or add --fresh to start from nothing",
        )
    kw.update({name: restored[name] for name in _LAYOUT_FIELDS if name in restored})
    click.echo(f"zkv up: restoring the bus of {path}: {describe(snap)}")
    return snap, snap["world"]


def _start(cluster: Any, attach: bool, timeout: float) -> StatusReply:
    """Start every process and wait (bounded) for the ranks; a process that
    exits meanwhile (a taken port, a bad option) ends the wait at once."""
    if attach:
        cluster.start_engines()
    cluster.start_broker()
    for rank in range(cluster.ranks):
        cluster.start_worker(rank)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return cluster.wait_ready(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise


def _start_or_fail(cluster: Any, attach: bool) -> StatusReply:
    try:
        return _start(cluster, attach, timeout=120)
    except RuntimeError as err:  # a process exited; its own error line is above
        usage = str(err).endswith("exited with 2")  # a value it refused: a usage error here too
        fail(f"the bus did not start: {err}", "see the error above", 2 if usage else 1)
    except TimeoutError as err:
        fail(f"the bus did not start: {err}", "see the processes' output above")
    raise AssertionError("unreachable")


def _remove_sockets(endpoints: Endpoints) -> None:
    """Once our broker is gone, no socket file of its addresses serves anyone."""
    for address in (endpoints.frontend, endpoints.backend, endpoints.control):
        if address.startswith("ipc://"):
            Path(address[len("ipc://") :]).unlink(missing_ok=True)


def _say_state(st: StatusReply, restored: bool) -> None:
    state = st.state
    how = ", as it was restored" if restored else ""
    if state is BusState.PAUSED:
        click.echo(f"zkv up: the bus is PAUSED{how}: tasks are held until you run: zkv resume")
    elif state is BusState.CLEARED:
        click.echo(
            f"zkv up: the bus is CLEARED{how}: the caches are freed and tasks are rejected "
            "until you run: zkv resume (it reallocates them)"
        )
    elif state not in (None, BusState.RUNNING):
        click.echo(f"zkv up: the bus is {str(state).upper()}; see zkv status")


def _tier_args(kw: dict[str, Any]) -> tuple[list[str], str]:
    """The tier and disk options every rank gets (each rank keeps files of its own
    there: a tier file per rank and layout, ``zkv-rankR.disk``), and the tier directory."""
    tier_dir, disk_dir = kw.pop("tier_dir"), kw.pop("disk_dir")
    args = ["--tier-dir", tier_dir, "--tier-digests" if kw.pop("tier_digests") else "--no-tier-digests"]
    blocks = kw.pop("disk_blocks")
    if disk_dir is not None:
        args += ["--disk-dir", os.path.abspath(disk_dir), "--disk-blocks", str(blocks)]
    return args, tier_dir


DEMO_DISK_BLOCKS = 2048  # the demo's chat outgrows GPU + CPU; its disk peak stays well below this


def _check_engine(engine: str, demo: bool) -> None:
    if not demo:
        fail(f"--engine {engine} runs only with --demo", f"zkv up --demo --engine {engine}")
    if engine in ("vllm", "vllm-servers"):
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            fail(
                f"--engine {engine} needs vLLM (Python 3.11+; its own environment, docs/engine-vllm.md)",
                f"bash tests/vllm_setup.sh && .venv-vllm/bin/zkv up --demo --engine {engine}",
            )
        return
    try:
        import transformers  # noqa: F401
    except ImportError:
        fail("--engine transformers needs the transformers extra", "pip install -e '.[transformers]'")


def _demo_disk(cluster: Any, demo: bool, user_disk: bool, disk_blocks: int) -> tuple[Path | None, int]:
    """The demo's ranks get a disk tier: the one --disk-dir names, else one in the
    runtime directory, removed when the demo ends, of --disk-blocks blocks
    (DEMO_DISK_BLOCKS unless given).  Returns the directory to remove and the blocks."""
    if not demo or user_disk:
        return None, disk_blocks
    if "disk_blocks" not in _explicit(("disk_blocks",)):
        disk_blocks = DEMO_DISK_BLOCKS
    disk_dir = cluster.directory / "demo-disk"
    cluster.worker_args += ["--disk-dir", str(disk_dir), "--disk-blocks", str(disk_blocks)]
    return disk_dir, disk_blocks


def _claim_runtime_dir(
    runtime_dir: str, fresh: bool, ranks: int, demo: bool, kw: dict[str, Any]
) -> tuple[dict[str, Any] | None, int]:
    """Refuse a runtime directory a live bus serves; read the snapshot its broker will restore."""
    from ..broker.state_file import FILE_NAME
    from ..client.client import Client, ZkvError
    from ..harness.bus import lifeline

    frontend = Endpoints.in_dir(runtime_dir).frontend
    up_pid = lifeline.running(runtime_dir)
    if up_pid is not None:
        fail(
            f"zkv up (pid {up_pid}) is already running a bus at {frontend}",
            f"stop it with: zkv down --runtime-dir {runtime_dir}, or pass another --runtime-dir",
        )
    with Client(frontend, request_timeout=0.3) as probe:
        try:
            probe.ping()
            fail(
                f"a bus is already running at {frontend} (a broker started on its own, not by zkv up)",
                "stop that broker first (SIGTERM), or pass another --runtime-dir",
            )
        except ZkvError:
            pass  # nobody answers: ours to take
    # The broker inherits ZKV_STATE_FILE from this environment: read the file it will restore.
    state_path = Path(os.environ.get("ZKV_STATE_FILE") or Path(runtime_dir) / FILE_NAME)
    restored, ranks = _restore(state_path, fresh, ranks, kw)
    if demo and restored is not None and restored["state"] != "running":
        fail(f"--demo needs a running bus; the restored one is {restored['state']}", "add --fresh")
    return restored, ranks


@click.command()
@env_option(
    "--ranks",
    type=click.IntRange(1, MAX_WORLD),
    default=2,
    envvar="ZKV_RANKS",
    help="Rank workers to start (a restored bus: its world size).",
)
@runtime_dir_option(
    "Directory for the ipc:// sockets and the broker state file (default: the one every zkv command looks "
    "in, $XDG_RUNTIME_DIR/zkv or /tmp/zkv-$UID; with --demo a private temp dir)."
)
@layout_options
@env_option(
    "--fresh",
    is_flag=True,
    envvar="ZKV_UP_FRESH",
    help="Start from nothing: move the runtime directory's broker-state.json aside (to .old) instead of "
    "restoring the bus it describes.",
)
@record_option
@env_option(
    "--demo",
    is_flag=True,
    envvar="ZKV_UP_DEMO",
    help="Run a demo workload against the cluster, print what it did, and exit.",
)
@env_option(
    "--requests",
    type=click.IntRange(1, 1 << 20),
    default=160,
    envvar="ZKV_UP_REQUESTS",
    help="Requests in the --demo workload (half with the disk tier, half without).",
)
@env_option(
    "--attach",
    is_flag=True,
    envvar="ZKV_UP_ATTACH",
    help="Also start one stand-in engine process per rank that owns the rank's KV tensors "
    "(shared memory); the workers attach to them (zkv worker --attach) instead of allocating their own.",
)
@env_option(
    "--engine",
    type=click.Choice(["zkv", "transformers", "vllm", "vllm-servers"]),
    default="zkv",
    envvar="ZKV_UP_ENGINE",
    help="With --demo: whose KV cache the ranks serve; 'transformers' runs a chat on a real transformers model "
    "(pip install 'zkv[transformers]'), one replica per rank with the rank attached in-process; 'vllm' a chat "
    "on a vLLM engine with zkv as its offload backend (one rank: the engine's own, docs/engine-vllm.md; vLLM's own "
    "logging shows errors only unless VLLM_LOGGING_LEVEL is set, e.g. to INFO); "
    "'vllm-servers' two vLLM servers with zkv through an RL cycle to new weights and one that fails and rolls back.",
)
@tier_options
@disk_options
@metrics_options
def up(
    ranks: int,
    runtime_dir: str | None,
    fresh: bool,
    record: str | None,
    demo: bool,
    requests: int,
    attach: bool,
    engine: str,
    metrics_port: int | None,
    metrics_addr: str,
    **kw: Any,
) -> None:
    """Start a broker and RANKS workers locally; Ctrl-C stops them all."""
    if engine == "vllm-servers":
        _check_engine(engine, demo)
        from ..harness.vllm.server_fleet import demo as servers_demo

        sys.exit(0 if servers_demo(say=click.echo) else 1)
    if engine == "vllm":
        _check_engine(engine, demo)
        from ..harness.vllm.demo import run_vllm_demo
        from ..harness.vllm.output import log_path
        from ..harness.vllm.rig import quiet_vllm_logging

        log = log_path("vllm-demo")  # vLLM's own output, unless the user asked to see it
        quiet = quiet_vllm_logging(say=click.echo, log=log)  # before anything imports vllm: its processes inherit it
        sys.exit(0 if run_vllm_demo(echo=click.echo, log=log if quiet else None) else 1)
    if engine == "transformers":
        _check_engine(engine, demo)
        from ..harness.transformers.demo import run_engine_demo

        sys.exit(0 if run_engine_demo(ranks, echo=click.echo) else 1)
    from ..harness.bus.cluster import LocalCluster
    from ..net.endpoints import runtime_dir as default_runtime_dir
    from ..obs.prometheus import check_port_free

    if metrics_port is not None:
        try:
            check_port_free(metrics_port, metrics_addr)
        except OSError as err:
            fail(
                f"cannot serve metrics on {metrics_addr}:{metrics_port}: {err.strerror or err}",
                "pick another --metrics-port, or 0 for a free one",
            )
    if runtime_dir is None and not demo:
        runtime_dir = str(default_runtime_dir())  # so zkv status & co. find it with no settings
    restored = None
    if runtime_dir is not None:
        restored, ranks = _claim_runtime_dir(runtime_dir, fresh, ranks, demo, kw)
    layout = layout_from(kw)
    disk_blocks, user_disk = kw["disk_blocks"], kw["disk_dir"] is not None
    worker_args, tier_dir = _tier_args(kw)
    broker_args = (
        ["--metrics-port", str(metrics_port), "--metrics-addr", metrics_addr] if metrics_port is not None else []
    )
    if record:
        broker_args += ["--record", record]
    opts: dict[str, Any] = {
        "directory": runtime_dir,
        "broker_args": broker_args,
        "worker_args": worker_args,
        "tier_dir": tier_dir,
    }
    if attach:
        from ..harness.bus.attached_cluster import AttachedCluster  # torch: only when it is needed

        cluster: Any = AttachedCluster(ranks, layout, die_with_parent=True, **opts)
    else:
        cluster = LocalCluster(ranks, layout, die_with_parent=True, **opts)
    demo_disk, disk_blocks = _demo_disk(cluster, demo, user_disk, disk_blocks)
    sigterm_as_interrupt()
    held = None if demo else hold_up_lock(cluster.directory)
    try:
        st = _start_or_fail(cluster, attach)
        owner = f", attached to the tensors of {counted(ranks, 'engine process')}" if attach else ""
        click.echo(f"zkv up: broker + {counted(ranks, 'rank')} ready at {cluster.endpoints.frontend}{owner}")
        _say_state(st, restored is not None)
        if demo:
            from ..harness.prefix.demo import run_demo

            update = cluster.reallocate if attach else None
            ok = run_demo(
                cluster.endpoints.frontend, layout, requests, echo=click.echo, update=update, disk_blocks=disk_blocks
            )
            if not ok:
                sys.exit(1)
            return
        click.echo(f"zkv up: a rank that exits is started again; zkv down --runtime-dir {cluster.directory} stops all")
        click.echo("Ctrl-C to stop.")
        supervise(cluster)
    except KeyboardInterrupt:
        click.echo("zkv up: stopping")
    finally:
        if held is not None:
            held.release()
        cluster.stop()
        _remove_sockets(cluster.endpoints)
        if demo_disk is not None:
            shutil.rmtree(demo_disk, ignore_errors=True)  # the demo's own disk files: nobody reuses them
