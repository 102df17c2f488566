"""``zkv up``: a whole bus on this machine (a broker and its rank workers,
optionally engine processes that own the KV tensors, and a demo workload), as
child processes that stop together.  The processes themselves are the
commands of ``commands.py``."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ..net.endpoints import Endpoints
from .options import fail, layout_from, layout_options, metrics_options, sigterm_as_interrupt


@click.command()
@click.option(
    "--ranks",
    type=int,
    default=2,
    show_default=True,
    envvar="ZKV_RANKS",
    show_envvar=True,
    help="Rank workers to start.",
)
@click.option(
    "--runtime-dir",
    type=click.Path(file_okay=False),
    default=None,
    envvar="ZKV_RUNTIME_DIR",
    show_envvar=True,
    help="Directory for the ipc:// sockets (default: the one every zkv command looks in, "
    "$XDG_RUNTIME_DIR/zkv or /tmp/zkv-$UID; with --demo a private temp dir).",
)
@layout_options
@click.option("--demo", is_flag=True, help="Run a demo workload against the cluster, print what it did, and exit.")
@click.option("--requests", type=int, default=200, show_default=True, help="Requests in the --demo workload.")
@click.option(
    "--attach",
    is_flag=True,
    help="Also start one stand-in engine process per rank that owns the rank's KV tensors "
    "(shared memory); the workers attach to them (zkv worker --attach) instead of allocating their own.",
)
@click.option(
    "--engine",
    type=click.Choice(["zkv", "transformers"]),
    default="zkv",
    show_default=True,
    help="With --demo: whose KV cache the ranks serve; 'transformers' runs a chat on a real transformers model "
    "(pip install 'zkv[transformers]'), one replica per rank with the rank attached in-process.",
)
@metrics_options
def up(
    ranks: int,
    runtime_dir: str | None,
    demo: bool,
    requests: int,
    attach: bool,
    engine: str,
    metrics_port: int | None,
    metrics_addr: str,
    **kw: Any,
) -> None:
    """Start a broker and RANKS workers locally; Ctrl-C stops them all."""
    if engine == "transformers":
        if not demo:
            fail("--engine transformers runs only with --demo", "zkv up --demo --engine transformers")
        from ..harness.engine_demo import run_engine_demo

        sys.exit(0 if run_engine_demo(ranks, echo=click.echo) else 1)
    from ..client.client import Client, ZkvError
    from ..harness.attached_cluster import AttachedCluster
    from ..harness.cluster import LocalCluster
    from ..net.endpoints import runtime_dir as default_runtime_dir

    layout = layout_from(kw)
    if runtime_dir is None and not demo:
        runtime_dir = str(default_runtime_dir())  # so zkv status & co. find it with no settings
    if runtime_dir is not None:
        frontend = Endpoints.in_dir(runtime_dir).frontend
        with Client(frontend, request_timeout=0.3) as probe:
            try:
                probe.ping()
                fail(f"a bus is already running at {frontend}", "stop it first, or pass another --runtime-dir")
            except ZkvError:
                pass  # nobody answers: ours to take
    metrics = ["--metrics-port", str(metrics_port), "--metrics-addr", metrics_addr] if metrics_port is not None else []
    cluster_type = AttachedCluster if attach else LocalCluster
    cluster = cluster_type(ranks, layout, directory=runtime_dir, broker_args=metrics)
    sigterm_as_interrupt()
    try:
        cluster.start(timeout=120)
        owner = f", attached to the tensors of {ranks} engine processes" if attach else ""
        click.echo(f"zkv up: broker + {ranks} ranks ready at {cluster.endpoints.frontend}{owner}")
        if demo:
            from ..harness.demo import run_demo

            update = cluster.reallocate if isinstance(cluster, AttachedCluster) else None
            ok = run_demo(cluster.endpoints.frontend, layout, requests, echo=click.echo, update=update)
            if not ok:
                sys.exit(1)
            return
        click.echo("Ctrl-C to stop.")
        names = {p.pid: f"rank {r}" for r, p in cluster.workers.items()}
        names[cluster.broker.pid] = "broker"  # type: ignore[union-attr]
        names.update({e.proc.pid: f"engine {r}" for r, e in getattr(cluster, "engines", {}).items()})
        pid, status = os.wait()  # blocks until a child exits (or Ctrl-C / SIGTERM)
        fail(f"{names.get(pid, pid)} exited with code {os.waitstatus_to_exitcode(status)}", "see its log above")
    except KeyboardInterrupt:
        click.echo("zkv up: stopping")
    finally:
        cluster.stop()
