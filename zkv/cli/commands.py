"""The ``zkv`` command group and the commands that run the bus's processes:
``broker``, ``worker`` and ``keygen`` (``up`` starts them all in ``up.py``; the
client commands are in ``control.py``, ``bench`` and ``trace`` in modules of
their own).

Every option has an environment-variable fallback (shown in ``--help``).
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Callable

import click
import zmq

from ..net.endpoints import Endpoints
from .options import (
    broker_options,
    curve_from,
    curve_options,
    disk_from,
    disk_options,
    fail,
    given_layout_fields,
    layout_from,
    layout_options,
    metrics_options,
    record_option,
    sigterm_as_interrupt,
    tier_options,
)

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
@click.version_option(None, "--version", package_name="zkv", prog_name="zkv", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def main(verbose: int) -> None:
    """zkv: a KV-cache transfer bus over ZeroMQ."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


# --- processes ----------------------------------------------------------------------


def _check_metrics_port(port: int | None, addr: str) -> None:
    """Refuse a port that cannot be served before anything is bound."""
    if port is None:
        return
    from ..obs.prometheus import check_port_free

    try:
        check_port_free(port, addr)
    except OSError as err:
        fail(
            f"cannot serve metrics on {addr}:{port}: {err.strerror or err}",
            "pick another --metrics-port, or 0 for a free one",
        )


def _start_metrics(broker: Any, port: int | None, addr: str) -> Any:
    """The broker's /metrics server, or None without a port; a port taken
    since the check closes the broker (its socket files go with it)."""
    if port is None:
        return None
    from ..obs.prometheus import make_registry, start_metrics_server

    try:
        server = start_metrics_server(port, make_registry(broker.core), addr)
    except OSError:
        broker.close()
        _check_metrics_port(port, addr)  # names the error
        raise
    click.echo(f"zkv broker: metrics at {server.url}", err=True)
    return server


def _say_restored(state_file: str | None, frontend: str, world: int) -> None:
    """What the broker is about to restore, before it binds anything."""
    from ..broker.state_file import default_state_path
    from .state import describe, load_state

    path = state_file or default_state_path(frontend)
    if path is None:
        return
    try:
        loaded = load_state(path)
    except (ValueError, OSError):
        return  # the broker itself refuses it, with the reason
    if loaded is not None and loaded[1]["world"] == world:
        click.echo(f"zkv broker: restoring {path}: {describe(loaded[1])}", err=True)


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
@record_option
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
    help="Durable bus state (state, epoch, generation, layout), so a restart keeps what clients set. "
    "Default: broker-state.json beside an ipc:// frontend.",
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
    _check_metrics_port(metrics_port, metrics_addr)
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
    except zmq.ZMQError as err:  # an address in use or not ours: the sockets bound so far are closed
        fail(f"cannot bind the broker's sockets: {err}", "check --frontend / --backend / --control")
    _say_restored(state_file, frontend, world_size)
    click.echo(f"zkv broker: clients {frontend}, ranks {backend}, control {control}, world size {world_size}", err=True)
    exporter = _start_metrics(b, metrics_port, metrics_addr)
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
    help="Serve the KV tensors an engine exported in this manifest (zkv.rank.cache.manifest) "
    "instead of allocating a cache; --cpu-blocks sizes zkv's CPU tier. Without other layout options the "
    "rank announces the layout of the engine's memory (its block count and bytes per block); layout "
    "options given must agree with that memory, else the worker exits naming both. On resume the "
    "manifest is read again and must carry a newer cache. The CPU tier and disk tier options apply as "
    "to any worker: a restart attached to the same engine maps its CPU tier again.",
)
@disk_options
@tier_options
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
    tier_dir: str,
    tier_digests: bool,
    **kw: Any,
) -> None:
    """Run one rank worker holding its KV cache shard (or serving an engine's, with --attach)."""
    from ..rank.cache.errors import CacheError
    from ..rank.registration import RankRefused
    from ..rank.worker import RankWorker, set_torch_threads

    sigterm_as_interrupt()  # until the loop can take a stop request
    set_torch_threads(torch_threads)
    given = given_layout_fields(click.get_current_context())
    layout = layout_from(kw)
    curve, disk = curve_from(kw), disk_from(kw)
    from ..rank import attach_rank

    tiers = None if tier_dir in ("", "none") else tier_dir
    opts = {"liveness_ms": liveness_ms, "curve": curve, "disk": disk, "tier_dir": tiers, "tier_digests": tier_digests}
    try:
        if manifest is None:
            w = RankWorker(rank, world_size, backend, control, layout, device=device, **opts)
        else:
            claim = {name: getattr(layout, name) for name in given} | {"cpu_blocks": layout.cpu_blocks}
            w = attach_rank(manifest, rank, world_size, backend, control, claim, **opts)
    except CacheError as err:
        if manifest is None or err.code in ("tier_in_use", "disk_busy"):
            fail(
                f"rank {rank} cannot open its tiers: {err}",
                "is another worker of this rank running (--tier-dir, --disk-dir)?",
            )
        fail(f"rank {rank} cannot attach {manifest}: {err}", "check that the engine exported it and is still running")
    lay = w.cache.layout
    what = f"attached to {manifest} ({lay.gpu_blocks} blocks of {lay.block_bytes} bytes)" if manifest else "of cache"
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
from .shm import shm  # noqa: E402

main.add_command(bench)
main.add_command(shm)
for command in (status, submit, pause, clear, resume):
    main.add_command(command)

from .state import state  # noqa: E402
from .tier import tier  # noqa: E402
from .trace import replay, trace  # noqa: E402
from .up import up  # noqa: E402

main.add_command(state)
main.add_command(tier)

main.add_command(trace)
main.add_command(replay)
main.add_command(up)
