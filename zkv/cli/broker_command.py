"""``zkv broker``: the broker process (its own module, so that a rank
worker's start never imports the broker's modules: ``commands.main`` loads a
command's module when it is run)."""

from __future__ import annotations

from typing import Any

import click
import zmq

from ..net.endpoints import Endpoints
from .commands import endpoint_option, endpoint_options, stop_on_signals
from .options import (
    broker_config_from,
    broker_options,
    curve_from,
    curve_options,
    env_option,
    fail,
    metrics_options,
    record_option,
    sigterm_as_interrupt,
    state_file_option,
    world_size_option,
)


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


@click.command()
@endpoint_option("frontend", "Address clients connect to.")
@endpoint_options
@world_size_option("Ranks a task runs on.")
@broker_options
@record_option
@env_option(
    "--allow-remote",
    is_flag=True,
    envvar="ZKV_ALLOW_REMOTE",
    help="Allow binding non-loopback TCP addresses without CurveZMQ.",
)
@state_file_option(
    "Durable bus state (state, epoch, generation, layout), so a restart keeps what clients set. "
    "Default: broker-state.json beside an ipc:// frontend."
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
            broker_config_from(world_size, kw),
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
    stop_on_signals(b.stop)
    try:
        b.serve()
    except KeyboardInterrupt:
        pass
    finally:
        if exporter is not None:
            exporter.close()
        if recorder is not None:
            recorder.close()
