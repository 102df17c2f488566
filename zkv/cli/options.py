"""Click options shared by the zkv commands (one definition each): the
broker's limits, the cache layout, CurveZMQ and the metrics exporter."""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable, NoReturn

import click

from ..wire.bounds import LAYOUT_MAX, MAX_TIMEOUT_MS
from ..wire.vocab import Dtype


def stacked(fn: Callable, opts: list[Callable]) -> Callable:
    """Apply click options so that ``--help`` lists them in the order given."""
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def broker_options(fn: Callable) -> Callable:
    """The broker's limits and timers (broker, up)."""
    from ..broker.core import BrokerConfig

    d = BrokerConfig()
    opts = [
        click.option(
            "--max-inflight",
            type=click.IntRange(1, 1 << 20),
            default=d.max_inflight_per_rank,
            show_default=True,
            envvar="ZKV_MAX_INFLIGHT",
            show_envvar=True,
            help="Credits: tasks in flight per rank.",
        ),
        click.option(
            "--max-queue",
            type=click.IntRange(1, 1 << 30),
            default=d.max_queue,
            show_default=True,
            envvar="ZKV_MAX_QUEUE",
            show_envvar=True,
            help="Tasks held before submissions are rejected.",
        ),
        click.option(
            "--heartbeat-ms",
            type=click.IntRange(1, MAX_TIMEOUT_MS),
            default=d.heartbeat_ms,
            show_default=True,
            envvar="ZKV_HEARTBEAT_MS",
            show_envvar=True,
            help="Heartbeat interval, both ways.",
        ),
        click.option(
            "--liveness-ms",
            type=click.IntRange(1, MAX_TIMEOUT_MS),
            default=d.liveness_ms,
            show_default=True,
            envvar="ZKV_LIVENESS_MS",
            show_envvar=True,
            help="Silence after which a rank is dead.",
        ),
        click.option(
            "--op-timeout-ms",
            type=click.IntRange(1, MAX_TIMEOUT_MS),
            default=d.op_timeout_ms,
            show_default=True,
            envvar="ZKV_OP_TIMEOUT_MS",
            show_envvar=True,
            help="Default bound on pause/clear/resume.",
        ),
        click.option(
            "--max-open-per-client",
            type=click.IntRange(1, 1 << 30),
            default=d.max_open_per_client,
            show_default=True,
            envvar="ZKV_MAX_OPEN_PER_CLIENT",
            show_envvar=True,
            help="Open tasks (queued or in flight) one client connection may hold; more are rejected.",
        ),
        click.option(
            "--max-waiters-per-client",
            type=click.IntRange(1, 1 << 20),
            default=d.max_waiters_per_client,
            show_default=True,
            envvar="ZKV_MAX_WAITERS_PER_CLIENT",
            show_envvar=True,
            help="Held status --wait-ranks requests per client connection.",
        ),
        click.option(
            "--max-waiters",
            type=click.IntRange(1, 1 << 20),
            default=d.max_waiters,
            show_default=True,
            envvar="ZKV_MAX_WAITERS",
            show_envvar=True,
            help="Held status --wait-ranks requests in all.",
        ),
        click.option(
            "--allow-partial",
            is_flag=True,
            envvar="ZKV_ALLOW_PARTIAL",
            show_envvar=True,
            help="A rank dying during pause/clear/resume completes it without that rank instead of failing it.",
        ),
    ]
    return stacked(fn, opts)


def layout_options(fn: Callable) -> Callable:
    """The cache-layout options (worker, up, trace gen)."""
    from ..wire.layout import CacheLayout

    d = CacheLayout()
    opts = [
        click.option(
            "--layers",
            type=click.IntRange(1, LAYOUT_MAX["layers"]),
            default=d.layers,
            show_default=True,
            envvar="ZKV_LAYERS",
            show_envvar=True,
            help="Transformer layers (a K and a V tensor each).",
        ),
        click.option(
            "--gpu-blocks",
            type=click.IntRange(1, LAYOUT_MAX["gpu_blocks"]),
            default=d.gpu_blocks,
            show_default=True,
            envvar="ZKV_GPU_BLOCKS",
            show_envvar=True,
            help="Device cache blocks per rank.",
        ),
        click.option(
            "--cpu-blocks",
            type=click.IntRange(1, LAYOUT_MAX["cpu_blocks"]),
            default=d.cpu_blocks,
            show_default=True,
            envvar="ZKV_CPU_BLOCKS",
            show_envvar=True,
            help="CPU swap-space blocks per rank.",
        ),
        click.option(
            "--block-size",
            type=click.IntRange(1, LAYOUT_MAX["block_size"]),
            default=d.block_size,
            show_default=True,
            envvar="ZKV_BLOCK_SIZE",
            show_envvar=True,
            help="Tokens per block.",
        ),
        click.option(
            "--kv-heads",
            type=click.IntRange(1, LAYOUT_MAX["kv_heads"]),
            default=d.kv_heads,
            show_default=True,
            envvar="ZKV_KV_HEADS",
            show_envvar=True,
            help="KV heads per rank (this rank's shard).",
        ),
        click.option(
            "--head-dim",
            type=click.IntRange(1, LAYOUT_MAX["head_dim"]),
            default=d.head_dim,
            show_default=True,
            envvar="ZKV_HEAD_DIM",
            show_envvar=True,
            help="Head dimension.",
        ),
        click.option(
            "--dtype",
            type=click.Choice([t.value for t in Dtype]),
            default=d.dtype,
            show_default=True,
            envvar="ZKV_DTYPE",
            show_envvar=True,
            help="Cache element type.",
        ),
    ]
    return stacked(fn, opts)


def layout_change_options(fn: Callable) -> Callable:
    """The layout a resume may give the bus after a clear (resume): each option unset
    keeps the bus's value.  All of them, so that the bus can be brought to the layout of
    a rank whose memory an engine fixes."""
    helps = {
        "gpu_blocks": "New device blocks per rank.",
        "cpu_blocks": "New CPU blocks per rank.",
        "layers": "New number of layers.",
        "block_size": "New tokens per block.",
        "kv_heads": "New KV heads per rank.",
        "head_dim": "New head dimension.",
    }
    opts = [
        click.option(
            f"--{name.replace('_', '-')}",
            type=click.IntRange(1, LAYOUT_MAX[name]),
            default=None,
            envvar=f"ZKV_RESUME_{name.upper()}",
            show_envvar=True,
            help=f"{text} Needs cleared caches.",
        )
        for name, text in helps.items()
    ]
    opts.append(
        click.option(
            "--dtype",
            type=click.Choice([t.value for t in Dtype]),
            default=None,
            envvar="ZKV_RESUME_DTYPE",
            show_envvar=True,
            help="New cache element type. Needs cleared caches.",
        )
    )
    return stacked(fn, opts)


def layout_change(kwargs: dict) -> dict[str, Any]:
    """The layout fields a resume's options named (``layout_change_options``), taken out of ``kwargs``."""
    names = ("gpu_blocks", "cpu_blocks", "layers", "block_size", "kv_heads", "head_dim", "dtype")
    return {k: v for k in names if (v := kwargs.pop(k, None)) is not None}


def resume_flags(layout: dict[str, Any]) -> str:
    """The ``zkv resume`` options that bring a bus to ``layout`` (a layout's map)."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in layout.items() if k != "v")


LAYOUT_OPTIONS = ("layers", "gpu_blocks", "block_size", "kv_heads", "head_dim", "dtype")  # what --attach checks


def given_layout_fields(ctx: click.Context) -> list[str]:
    """The layout options set on the command line or in the environment, not left
    at their defaults (a rank on engine memory checks those, derives the rest)."""
    from click.core import ParameterSource

    return [n for n in LAYOUT_OPTIONS if ctx.get_parameter_source(n) not in (None, ParameterSource.DEFAULT)]


def layout_from(kwargs: dict) -> Any:
    from ..wire.layout import CacheLayout
    from ..wire.protocol import ProtocolError

    fields = {
        k: kwargs.pop(k) for k in ("layers", "gpu_blocks", "cpu_blocks", "block_size", "kv_heads", "head_dim", "dtype")
    }
    try:
        return CacheLayout(**fields)
    except ProtocolError as err:
        raise click.BadParameter(err.reason) from None


def disk_options(fn: Callable) -> Callable:
    """A rank's disk tier below its CPU tier (worker): off unless --disk-dir is given."""
    opts = [
        click.option(
            "--disk-dir",
            default=None,
            type=click.Path(file_okay=False),
            envvar="ZKV_DISK_DIR",
            show_envvar=True,
            help="Directory of this rank's disk tier file (zkv-rankR.disk), reused across restarts for the same "
            "layout; O_DIRECT when the file system takes it, else buffered I/O with fdatasync.",
        ),
        click.option(
            "--disk-blocks",
            type=click.IntRange(1, 2**31 - 1),
            default=4096,
            show_default=True,
            envvar="ZKV_DISK_BLOCKS",
            show_envvar=True,
            help="Blocks the disk tier holds (with --disk-dir); the file is preallocated.",
        ),
    ]
    return stacked(fn, opts)


def store_option(fn: Callable) -> Callable:
    """A rank's keyed store below its CPU tier (worker, up): off unless --store is given."""
    return click.option(
        "--store",
        default=None,
        envvar="ZKV_STORE",
        show_envvar=True,
        metavar="URL",
        help="The keyed store below this rank's CPU tier (put / get tasks, named by key in a namespace of the "
        "engine's identity): file:///dev/shm/zkv-host?budget=8GiB is a host tier every engine on the host shares, "
        "redis://HOST:PORT/DB?timeout=1.0 a Redis tier shared by hosts (docs/operations.md, 'Keyed stores').",
    )(fn)


def disk_from(kwargs: dict) -> Any:
    """The ``DiskSpec`` of --disk-dir / --disk-blocks (popped from ``kwargs``), or None."""
    directory, blocks = kwargs.pop("disk_dir"), kwargs.pop("disk_blocks")
    if directory is None:
        return None
    from ..rank.tiers.disk_tier import DiskSpec

    return DiskSpec(directory, blocks)


def curve_options(server: bool = False, client: bool = True) -> Callable:
    """CurveZMQ options (docs/protocol.md §12): off unless --curve-secret is given."""

    def deco(fn: Callable) -> Callable:
        if server:  # ranks and clients are authorized separately (docs/protocol.md §12)
            if not client:  # the broker: client keys for its frontend
                fn = click.option(
                    "--curve-clients",
                    type=click.Path(exists=True, file_okay=False),
                    default=None,
                    envvar="ZKV_CURVE_CLIENTS",
                    show_envvar=True,
                    help="Directory of client public keys (*.key) allowed on the frontend.",
                )(fn)
            fn = click.option(
                "--curve-ranks",
                type=click.Path(exists=True, file_okay=False),
                default=None,
                envvar="ZKV_CURVE_RANKS",
                show_envvar=True,
                help="Directory of rank public keys (*.key): allowed on the broker's backend, "
                "and to push results to a client.",
            )(fn)
        if client:
            fn = click.option(
                "--curve-server",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                envvar="ZKV_CURVE_SERVER",
                show_envvar=True,
                help="The broker's public key file (broker.key).",
            )(fn)
        return click.option(
            "--curve-secret",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            envvar="ZKV_CURVE_SECRET",
            show_envvar=True,
            help="This party's Curve secret key file (NAME.key_secret, from zkv keygen); turns on CurveZMQ.",
        )(fn)

    return deco


def curve_from(kw: dict) -> Any:
    from ..net.curve import Curve

    secret = kw.pop("curve_secret", None)
    server = kw.pop("curve_server", None)
    ranks = kw.pop("curve_ranks", None)
    clients = kw.pop("curve_clients", None)
    if secret is None:
        if server or ranks or clients:
            raise click.BadParameter("--curve-server / --curve-ranks / --curve-clients need --curve-secret")
        return None
    return Curve(secret, server, ranks, clients)


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


def sigterm_as_interrupt() -> None:
    """SIGTERM (and SIGINT, even if inherited as ignored) end a process like
    Ctrl-C does: sockets closed, exit 0."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def fail(message: str, hint: str = "", code: int = 1) -> NoReturn:
    click.echo(f"zkv: error: {message}" + (f" ({hint})" if hint else ""), err=True)
    sys.exit(code)


def tier_options(fn: Callable) -> Callable:
    """Where a worker's CPU tier lives as a file that outlives it, and whether its rows keep digests."""
    return stacked(
        fn,
        [
            click.option(
                "--tier-dir",
                default="/dev/shm",
                show_default=True,
                envvar="ZKV_TIER_DIR",
                show_envvar=True,
                help="Where zkv's CPU tier lives as a file that outlives this process (a restarted rank maps "
                "it again and keeps its blocks; zkv tier list / clean). 'none': in process memory, gone with "
                "the process.",
            ),
            click.option(
                "--tier-digests/--no-tier-digests",
                default=False,
                show_default=True,
                envvar="ZKV_TIER_DIGESTS",
                show_envvar=True,
                help="Also keep a BLAKE2b digest of every CPU-tier block and check it when the block is read. "
                "A torn write is caught without it (each block's header is written last); the digest also "
                "catches bytes changed behind zkv's back, at the cost of hashing every block copied "
                "(several times the copy).",
            ),
        ],
    )


record_option = click.option(
    "--record",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="ZKV_RECORD",
    show_envvar=True,
    help="Append every request and task outcome to this trace file (JSON Lines).",
)
