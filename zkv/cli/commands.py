"""The ``zkv`` command group, the rank worker and ``keygen``.  Every other
command lives in a module of its own, loaded when it runs (``broker`` in
``broker_command.py``, ``up`` in ``up.py``, the client commands in
``control.py``, ``bench``, ``trace``, ...), so a worker's start imports what
a rank needs and nothing of the broker, the tools or the benchmarks.

Every option has an environment-variable fallback (shown in ``--help``:
``options.env_option``).
"""

from __future__ import annotations

import importlib
import logging
import signal
import sys
from typing import Any, Callable

import click

from ..net.endpoints import Endpoints
from ..wire.bounds import MAX_TIMEOUT_MS, MAX_WORLD
from .options import (
    curve_from,
    curve_options,
    disk_from,
    disk_options,
    env_option,
    fail,
    given_layout_fields,
    layout_from,
    layout_options,
    resume_flags,
    sigterm_as_interrupt,
    stacked,
    store_option,
    tier_options,
    world_size_option,
)

_DEFAULT = Endpoints.default


def stop_on_signals(stop: Callable[[], None]) -> None:
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


def endpoint_option(name: str, help: str) -> Callable:
    """``--NAME`` (``ZKV_NAME``): one of the broker's addresses, by default the one in the
    runtime directory every zkv command looks in (``Endpoints.default``)."""
    return env_option(
        f"--{name}",
        default=lambda: getattr(_DEFAULT(), name),
        show_default=False,
        envvar=f"ZKV_{name.upper()}",
        help=help,
    )


def endpoint_options(fn: Callable) -> Callable:
    """The broker's rank-facing addresses (broker, worker)."""
    return stacked(
        fn,
        [
            endpoint_option("backend", "Broker ROUTER address for ranks."),
            endpoint_option("control", "Broker PUB address for pause/clear/resume."),
        ],
    )


class LazyGroup(click.Group):
    """A group whose commands load on first use (``lazy``: name -> ``module:attr``
    of this package), so a rank worker's start imports the rank's modules and not
    the broker's, the benchmarks' or the tools'.  ``commands`` loads one when
    it is asked for it by name, as click's lookups and ``--help`` do."""

    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.commands = self._loader = _LazyCommands(lazy, dict(self.commands))

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """As click's, but a usage error (a bad option or environment value, a missing
        argument) is one line naming the command and its ``--help``, exit 2."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as err:
            where = err.ctx.command_path if err.ctx is not None else "zkv"
            click.echo(f"{where}: error: {err.format_message()} (see {where} --help)", err=True)
            sys.exit(err.exit_code)
        except click.ClickException as err:
            err.show()
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self._loader, *self._loader.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._loader.get(cmd_name)


class _LazyCommands(dict):
    """The commands of a ``LazyGroup``: those loaded, and the rest by name."""

    def __init__(self, lazy: dict[str, str], loaded: dict[str, click.Command]):
        super().__init__(loaded)
        self.lazy = lazy

    def __missing__(self, name: str) -> click.Command:
        if name not in self.lazy:
            raise KeyError(name)
        module, attr = self.lazy[name].split(":")
        command = self[name] = getattr(importlib.import_module(module, __package__), attr)
        return command

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default


_LAZY = {
    "broker": ".broker_command:broker",
    "bench": ".bench:bench",
    "cycle": ".cycle:cycle",
    "shm": ".shm:shm",
    **{name: f".control:{name}" for name in ("status", "pause", "clear", "resume")},
    "submit": ".submit:submit",
    "state": ".state:state",
    "tier": ".tier:tier",
    "store": ".store:store",
    "trace": ".trace:trace",
    "replay": ".trace:replay",
    "serve-vllm": ".serve_vllm:serve_vllm",
    "up": ".up:up",
    "down": ".supervise:down",
}


@click.group(cls=LazyGroup, lazy=_LAZY)
@click.version_option(None, "--version", package_name="zkv", prog_name="zkv", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def main(verbose: int) -> None:
    """zkv: a KV-cache transfer bus over ZeroMQ."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


# --- processes ----------------------------------------------------------------------


@main.command()
@env_option(
    "--rank",
    type=click.IntRange(0, MAX_WORLD - 1),
    required=True,
    envvar="ZKV_RANK",
    help="This worker's tensor-parallel rank.",
)
@world_size_option("Number of ranks.")
@endpoint_options
@layout_options
@env_option(
    "--device",
    default=None,
    envvar="ZKV_DEVICE",
    help="Torch device for the cache (default cuda:RANK if CUDA exists, else cpu).",
)
@env_option(
    "--liveness-ms",
    type=click.IntRange(1, MAX_TIMEOUT_MS),
    default=2000,
    envvar="ZKV_LIVENESS_MS",
    help="Broker silence after which this rank re-registers.",
)
@env_option(
    "--torch-threads",
    type=click.IntRange(1, 1024),
    default=1,
    envvar="ZKV_TORCH_THREADS",
    help="Torch intra-op threads for CPU copies.",
)
@env_option(
    "--copy-threads",
    type=click.IntRange(1, 2),
    default=None,
    envvar="ZKV_COPY_THREADS",
    help="Threads for one large CPU copy (8 MiB or more, in two halves at once) "
    "[default: 2 where the rank may use 4 cores or more, else 1].",
)
@env_option(
    "--attach",
    "manifest",
    default=None,
    type=click.Path(dir_okay=False),
    envvar="ZKV_ATTACH",
    help="Serve the KV tensors an engine exported in this manifest (zkv.rank.memory.manifest) "
    "instead of allocating a cache; --cpu-blocks sizes zkv's CPU tier. Without other layout options the "
    "rank announces the layout of the engine's memory (its block count and bytes per block); layout "
    "options given must agree with that memory, else the worker exits naming both. On resume the "
    "manifest is read again and must carry a newer cache. The CPU tier and disk tier options apply as "
    "to any worker: a restart attached to the same engine maps its CPU tier again.",
)
@disk_options
@store_option
@tier_options
@env_option(
    "--startup-times",
    default=None,
    type=click.Path(dir_okay=False),
    envvar="ZKV_STARTUP_TIMES",
    help="Append when each phase of this worker's start ended (imports, tiers mapped, READY, welcome, cache "
    "ready, first task) to this file, one JSON line each (zkv bench restart reads it).",
)
@env_option(
    "--standby",
    is_flag=True,
    envvar="ZKV_STANDBY",
    help="When another worker serves this rank of this bus on this host, start all the same (torch and every "
    "module loaded) and take over the moment it exits, kill -9 included: map its CPU tier again and register. "
    "Needs a --tier-dir (the rank's lock lives there). Without it such a worker is refused.",
)
@env_option(
    "--adopt-layout",
    is_flag=True,
    envvar="ZKV_ADOPT_LAYOUT",
    help="When the bus holds another layout than the layout options say, take the bus's (and say so in the log) "
    "instead of being refused. Without it the broker refuses such a worker, naming both layouts.",
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
    copy_threads: int | None,
    manifest: str | None,
    tier_dir: str,
    tier_digests: bool,
    startup_times: str | None,
    standby: bool,
    adopt_layout: bool,
    store: str | None,
    **kw: Any,
) -> None:
    """Run one rank worker holding its KV cache shard (or serving an engine's, with --attach)."""
    from ..obs import startup

    if rank >= world_size:  # before any memory is taken: no broker would ever admit it
        raise click.BadParameter(
            f"rank {rank} does not exist in a world of {world_size} (ranks 0 to {world_size - 1})", param_hint="--rank"
        )
    if manifest is not None and adopt_layout:  # a usage error: before torch is imported
        raise click.UsageError(
            "--adopt-layout cannot apply with --attach: the engine's memory fixes this rank's layout. Bring the "
            "bus to it instead (zkv pause, zkv clear, zkv resume with its layout options: the refusal names them)"
        )
    startup.mark("cli")
    if startup_times:
        startup.record_to(startup_times)
    tiers = None if tier_dir in ("", "none") else tier_dir
    lock = None if standby else _hold_rank(rank, backend, tiers, standby)  # refused at once, before torch
    from ..rank.copies.cpu_copy import set_copy_threads
    from ..rank.errors import CacheError
    from ..rank.registration import RankRefused
    from ..rank.worker import RankWorker, set_torch_threads

    startup.mark("imports")

    sigterm_as_interrupt()  # until the loop can take a stop request
    set_torch_threads(torch_threads)
    set_copy_threads(copy_threads)
    given = given_layout_fields(click.get_current_context())
    layout = layout_from(kw)
    curve, disk = curve_from(kw), disk_from(kw)
    from ..rank import attach_rank

    if standby:  # everything loaded: wait for the serving worker to go
        lock = _hold_rank(rank, backend, tiers, standby)
    opts = {"liveness_ms": liveness_ms, "curve": curve, "disk": disk, "tier_dir": tiers, "tier_digests": tier_digests}
    opts.update(adopt_layout=adopt_layout, note=lambda text: click.echo(f"zkv worker: {text}", err=True))
    opts["store"] = store
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
    except ValueError as err:  # a --store URL it cannot use
        fail(f"rank {rank} cannot use its store: {err}", "see zkv worker --help for the --store forms")
    startup.mark("tiers")
    lay = w.cache.layout
    what = f"attached to {manifest} ({lay.gpu_blocks} blocks of {lay.block_bytes} bytes)" if manifest else "of cache"
    click.echo(
        f"zkv worker: rank {rank}/{world_size} on {w.cache.device}, {w.cache.nbytes() / 2**20:.1f} MiB {what}", err=True
    )
    stop_on_signals(w.stop)
    try:
        w.serve()
    except RankRefused as err:
        if manifest is not None and "layout" in str(err):
            click.echo(
                f"zkv worker: this rank's layout is its engine's memory ({lay.gpu_blocks} blocks of "
                f"{lay.block_bytes} bytes; the fields below are zkv's way to write it, not the model's). "
                "To serve it, bring the bus to it:\n"
                f"  zkv pause; zkv clear; zkv resume {resume_flags(lay.to_wire())}",
                err=True,
            )
        fail(f"the broker refused rank {rank}: {err}")
    except KeyboardInterrupt:
        pass
    finally:
        if lock is not None:
            lock.release()


def _hold_rank(rank: int, backend: str, tiers: str | None, standby: bool) -> Any:
    """The rank's lock beside its tier files (``rank/tiers/rank_lock.py``): taken, or for
    a standby waited for (blocking until the serving worker is gone)."""
    if tiers is None:
        if standby:
            fail("--standby needs a --tier-dir: the rank's lock and its CPU tier file live there")
        return None
    from ..obs import startup
    from ..rank.tiers.rank_lock import RankBusy, RankLock
    from ..rank.tiers.tier_file import TierPlace, bus_name

    lock = RankLock(TierPlace(bus_name(backend), rank, tiers))

    def waiting(pid: int) -> None:
        click.echo(f"zkv worker: rank {rank} standby: pid {pid} serves it here; taking over when it exits", err=True)
        startup.mark("standby")

    try:
        lock.acquire(standby, waiting)
    except RankBusy as err:
        fail(
            f"rank {rank} of this bus is served on this host by pid {err.pid} ({err.path})",
            "stop that worker, or add --standby to take over when it exits",
        )
    startup.mark("lock")
    return lock


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
