"""The ``zkv`` command group and the commands that run the bus's processes:
``broker``, ``worker``, ``up`` and ``keygen`` (the client commands are in
``control.py``, ``bench`` and ``trace`` in modules of their own).

Every option has an environment-variable fallback (shown in ``--help``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Callable

import click

from ..net.endpoints import Endpoints
from .options import broker_options, curve_from, curve_options, fail, layout_from, layout_options, sigterm_as_interrupt

_DEFAULT = Endpoints.default


def _stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM / SIGINT ask the loop to stop at its next wakeup, so it never
    stops halfway through a batch of actions; a second signal interrupts."""
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def endpoint_options(fn: Callable) -> Callable:
    fn = click.option(
        "--control",
        default=lambda: _DEFAULT().control,
        envvar="ZKV_CONTROL",
        show_envvar=True,
        help="Broker PUB address for pause/clear/resume.",
    )(fn)
    fn = click.option(
        "--backend",
        default=lambda: _DEFAULT().backend,
        envvar="ZKV_BACKEND",
        show_envvar=True,
        help="Broker ROUTER address for ranks.",
    )(fn)
    return fn


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def main(verbose: int) -> None:
    """zkv: a KV-cache transfer bus over ZeroMQ."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


# --- processes ----------------------------------------------------------------------


def metrics_options(fn: Callable) -> Callable:
    """The Prometheus exporter of the broker (docs/operations.md): off unless a port is given."""
    fn = click.option(
        "--metrics-addr",
        default="127.0.0.1",
        show_default=True,
        envvar="ZKV_METRICS_ADDR",
        show_envvar=True,
        help="Address the /metrics endpoint binds (loopback unless you ask for more).",
    )(fn)
    return click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        envvar="ZKV_METRICS_PORT",
        show_envvar=True,
        help="Serve Prometheus metrics (the ranks' included) on http://ADDR:PORT/metrics; 0 picks a free port.",
    )(fn)


def _start_metrics(core: Any, port: int | None, addr: str) -> Any:
    """The broker's /metrics server, or None without a port."""
    if port is None:
        return None
    from ..obs.prometheus import make_registry, start_metrics_server

    try:
        server = start_metrics_server(port, make_registry(core), addr)
    except OSError as err:
        fail(
            f"cannot serve metrics on {addr}:{port}: {err.strerror or err}",
            "pick another --metrics-port, or 0 for a free one",
        )
    click.echo(f"zkv broker: metrics at {server.url}", err=True)
    return server


def _broker_config(world: int, kw: dict) -> Any:
    from ..broker.core import BrokerConfig

    return BrokerConfig(
        world=world,
        max_inflight_per_rank=kw["max_inflight"],
        max_queue=kw["max_queue"],
        heartbeat_ms=kw["heartbeat_ms"],
        liveness_ms=kw["liveness_ms"],
        op_timeout_ms=kw["op_timeout_ms"],
        allow_partial=kw["allow_partial"],
        max_open_per_client=kw["max_open_per_client"],
        max_waiters_per_client=kw["max_waiters_per_client"],
        max_waiters=kw["max_waiters"],
    )


@main.command()
@click.option(
    "--frontend",
    default=lambda: _DEFAULT().frontend,
    envvar="ZKV_FRONTEND",
    show_envvar=True,
    help="Address clients connect to.",
)
@endpoint_options
@click.option(
    "--world-size",
    type=int,
    default=2,
    show_default=True,
    envvar="ZKV_WORLD_SIZE",
    show_envvar=True,
    help="Ranks a task runs on.",
)
@broker_options
@click.option(
    "--record",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="ZKV_RECORD",
    show_envvar=True,
    help="Append every request and task outcome to this trace file (JSON Lines).",
)
@click.option(
    "--allow-remote",
    is_flag=True,
    envvar="ZKV_ALLOW_REMOTE",
    show_envvar=True,
    help="Allow binding non-loopback TCP addresses without CurveZMQ.",
)
@click.option(
    "--state-file",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="ZKV_STATE_FILE",
    show_envvar=True,
    help="Durable bus state (state, epoch, generation, layout), so a restart keeps what clients set. Default: broker-state.json beside an ipc:// frontend.",
)
@metrics_options
@curve_options(server=True, client=False)
def broker(
    frontend: str,
    backend: str,
    control: str,
    world_size: int,
    record: str | None,
    allow_remote: bool,
    state_file: str | None,
    metrics_port: int | None,
    metrics_addr: str,
    **kw: Any,
) -> None:
    """Run the broker (ROUTER frontend, ROUTER backend, PUB control)."""
    from ..broker.loop import Broker

    sigterm_as_interrupt()  # until the loop can take a stop request
    curve = curve_from(kw)
    if curve is not None and not (curve.ranks_dir and curve.clients_dir):
        raise click.BadParameter(
            "a Curve broker needs --curve-ranks (rank public keys) and --curve-clients (client public keys)"
        )
    recorder = None
    if record:
        from ..trace import TraceRecorder

        recorder = TraceRecorder(record, world=world_size)
    try:
        b = Broker(
            Endpoints(frontend, backend, control),
            _broker_config(world_size, kw),
            recorder=recorder,
            allow_remote=allow_remote,
            curve=curve,
            state_file=state_file,
        )
    except ValueError as err:
        fail(str(err))
    click.echo(f"zkv broker: clients {frontend}, ranks {backend}, control {control}, world size {world_size}", err=True)
    exporter = _start_metrics(b.core, metrics_port, metrics_addr)
    _stop_on_signals(b.stop)
    try:
        b.serve()
    except KeyboardInterrupt:
        pass
    finally:
        if exporter is not None:
            exporter.close()
        if recorder is not None:
            recorder.close()


@main.command()
@click.option(
    "--rank", type=int, required=True, envvar="ZKV_RANK", show_envvar=True, help="This worker's tensor-parallel rank."
)
@click.option(
    "--world-size",
    type=int,
    default=2,
    show_default=True,
    envvar="ZKV_WORLD_SIZE",
    show_envvar=True,
    help="Number of ranks.",
)
@endpoint_options
@layout_options
@click.option(
    "--device",
    default=None,
    envvar="ZKV_DEVICE",
    show_envvar=True,
    help="Torch device for the cache (default cuda:RANK if CUDA exists, else cpu).",
)
@click.option(
    "--liveness-ms",
    type=int,
    default=2000,
    show_default=True,
    envvar="ZKV_LIVENESS_MS",
    show_envvar=True,
    help="Broker silence after which this rank re-registers.",
)
@click.option(
    "--torch-threads",
    type=int,
    default=1,
    show_default=True,
    envvar="ZKV_TORCH_THREADS",
    show_envvar=True,
    help="Torch intra-op threads for CPU copies.",
)
@click.option(
    "--attach",
    "manifest",
    default=None,
    type=click.Path(dir_okay=False),
    envvar="ZKV_ATTACH",
    show_envvar=True,
    help="Serve the KV tensors an engine exported in this manifest (zkv.rank.cache.manifest) instead of allocating a cache; "
    "--cpu-blocks sizes zkv's CPU tier, the engine's block count is the layout's gpu_blocks. On resume the manifest is read again "
    "and must carry a newer generation.",
)
@curve_options(server=False, client=True)
def worker(
    rank: int,
    world_size: int,
    backend: str,
    control: str,
    device: str | None,
    liveness_ms: int,
    torch_threads: int,
    manifest: str | None,
    **kw: Any,
) -> None:
    """Run one rank worker holding its KV cache shard (or serving an engine's, with --attach)."""
    from ..rank.registration import RankRefused
    from ..rank.worker import RankWorker, set_torch_threads

    sigterm_as_interrupt()  # until the loop can take a stop request
    set_torch_threads(torch_threads)
    layout = layout_from(kw)
    curve = curve_from(kw)
    if manifest is None:
        w = RankWorker(rank, world_size, backend, control, layout, device=device, liveness_ms=liveness_ms, curve=curve)
    else:
        from ..rank import attach_rank
        from ..rank.cache.errors import CacheError

        try:
            w = attach_rank(manifest, rank, world_size, backend, control, layout, liveness_ms=liveness_ms, curve=curve)
        except CacheError as err:
            fail(
                f"rank {rank} cannot attach {manifest}: {err}", "check that the engine exported it and is still running"
            )
    what = f"attached to {manifest}" if manifest else "of cache"
    click.echo(
        f"zkv worker: rank {rank}/{world_size} on {w.cache.device}, {w.cache.nbytes() / 2**20:.1f} MiB {what}", err=True
    )
    _stop_on_signals(w.stop)
    try:
        w.serve()
    except RankRefused as err:
        fail(f"the broker refused rank {rank}: {err}", "check --world-size and the layout options")
    except KeyboardInterrupt:
        pass


@main.command()
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
    help="Directory for the ipc:// sockets (default: the one every zkv command looks in, $XDG_RUNTIME_DIR/zkv or /tmp/zkv-$UID; with --demo a private temp dir).",
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


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("names", nargs=-1, required=True)
def keygen(directory: str, names: tuple[str, ...]) -> None:
    """Write Curve keypairs NAME.key / NAME.key_secret (mode 0600) into DIRECTORY.

    Put the broker's secret with the broker, and copy every rank's and client's
    NAME.key into the directory of its role: rank keys into the one the broker and
    clients pass as --curve-ranks, client keys into the broker's --curve-clients.
    """
    from ..net.curve import generate_keypair

    for name in names:
        public, secret = generate_keypair(directory, name)
        click.echo(f"{name}: public {public}, secret {secret}")


from .bench import bench  # noqa: E402
from .control import clear, pause, resume, status, submit  # noqa: E402

main.add_command(bench)
for command in (status, submit, pause, clear, resume):
    main.add_command(command)

from .trace import replay, trace  # noqa: E402

main.add_command(trace)
main.add_command(replay)
