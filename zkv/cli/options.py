"""Click options shared by the zkv commands (one definition each): every
option's environment variable (``env_option``), the broker's limits, the cache
layout, CurveZMQ, the metrics exporter, and the options several commands take
(--json, --world-size, --state-file, --runtime-dir, bounds in seconds)."""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable, NoReturn

import click

from ..wire.bounds import LAYOUT_MAX, MAX_TIMEOUT_MS, MAX_WORLD
from ..wire.vocab import Dtype


def env_option(*decls: str, envvar: str | list[str], **attrs: Any) -> Callable:
    """A click option that falls back on the environment variable ``envvar``,
    named in ``--help`` as every zkv option's is, with its default shown (pass
    ``show_default=False`` where it is computed at run time)."""
    attrs.setdefault("show_default", True)
    return click.option(*decls, envvar=envvar, show_envvar=True, **attrs)


def stacked(fn: Callable, opts: list[Callable]) -> Callable:
    """Apply click options so that ``--help`` lists them in the order given."""
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def json_option(help: str) -> Callable:
    """--json (ZKV_JSON): one environment variable turns it on for every command that has it."""
    return env_option("--json", "as_json", is_flag=True, envvar="ZKV_JSON", help=help)


def seconds_option(*decls: str, envvar: str, help: str) -> Callable:
    """A bound in seconds on a request or an op: more than 0, at most the wire's longest
    timeout, 30 by default (--timeout of the client commands, replay's --task-timeout / --op-timeout)."""
    return env_option(
        *decls, type=click.FloatRange(0, MAX_TIMEOUT_MS / 1000, min_open=True), default=30.0, envvar=envvar, help=help
    )


def world_size_option(help: str) -> Callable:
    """--world-size (ZKV_WORLD_SIZE): the ranks of a bus, the same for its broker and its workers."""
    return env_option("--world-size", type=click.IntRange(1, MAX_WORLD), default=2, envvar="ZKV_WORLD_SIZE", help=help)


def state_file_option(help: str) -> Callable:
    """--state-file (ZKV_STATE_FILE): the broker's durable state (broker, state)."""
    return env_option("--state-file", type=click.Path(dir_okay=False), default=None, envvar="ZKV_STATE_FILE", help=help)


def runtime_dir_option(help: str) -> Callable:
    """--runtime-dir (ZKV_RUNTIME_DIR): where a zkv up keeps its sockets, state and lock (up, down)."""
    return env_option(
        "--runtime-dir", type=click.Path(file_okay=False), default=None, envvar="ZKV_RUNTIME_DIR", help=help
    )


def _flag(name: str) -> str:
    """A parameter's option: ``max_inflight`` -> ``--max-inflight``."""
    return "--" + name.replace("_", "-")


#: The broker's limits and timers: parameter -> (``BrokerConfig`` field, upper bound, help); each
#: falls back on ``ZKV_`` and its name (--max-inflight: ZKV_MAX_INFLIGHT) and defaults to the config's.
BROKER_LIMITS = {
    "max_inflight": ("max_inflight_per_rank", 1 << 20, "Credits: tasks in flight per rank."),
    "max_queue": ("max_queue", 1 << 30, "Tasks held before submissions are rejected."),
    "heartbeat_ms": ("heartbeat_ms", MAX_TIMEOUT_MS, "Heartbeat interval, both ways."),
    "liveness_ms": ("liveness_ms", MAX_TIMEOUT_MS, "Silence after which a rank is dead."),
    "op_timeout_ms": ("op_timeout_ms", MAX_TIMEOUT_MS, "Default bound on pause/clear/resume."),
    "max_open_per_client": (
        "max_open_per_client",
        1 << 30,
        "Open tasks (queued or in flight) one client connection may hold; more are rejected.",
    ),
    "max_waiters_per_client": (
        "max_waiters_per_client",
        1 << 20,
        "Held status --wait-ranks requests per client connection.",
    ),
    "max_waiters": ("max_waiters", 1 << 20, "Held status --wait-ranks requests in all."),
}


def broker_options(fn: Callable) -> Callable:
    """The broker's limits and timers (``BROKER_LIMITS``) and --allow-partial (broker)."""
    from ..broker.core import BrokerConfig

    d = BrokerConfig()
    opts = [
        env_option(
            _flag(name),
            type=click.IntRange(1, upper),
            default=getattr(d, field),
            envvar=f"ZKV_{name.upper()}",
            help=text,
        )
        for name, (field, upper, text) in BROKER_LIMITS.items()
    ]
    opts.append(
        env_option(
            "--allow-partial",
            is_flag=True,
            envvar="ZKV_ALLOW_PARTIAL",
            help="A rank dying during pause/clear/resume completes it without that rank instead of failing it.",
        )
    )
    return stacked(fn, opts)


def broker_config_from(world: int, kw: dict) -> Any:
    """The ``BrokerConfig`` of ``broker_options`` (read from ``kw``) for a bus of ``world`` ranks."""
    from ..broker.core import BrokerConfig

    limits = {field: kw[name] for name, (field, _, _) in BROKER_LIMITS.items()}
    return BrokerConfig(world=world, allow_partial=kw["allow_partial"], **limits)


#: The cache-layout options: ``CacheLayout`` field -> help; each falls back on ``ZKV_`` and its
#: name (ZKV_GPU_BLOCKS), is bounded by ``LAYOUT_MAX`` and defaults to ``CacheLayout()``'s.
LAYOUT_HELP = {
    "layers": "Transformer layers (a K and a V tensor each).",
    "gpu_blocks": "Device cache blocks per rank.",
    "cpu_blocks": "CPU swap-space blocks per rank.",
    "block_size": "Tokens per block.",
    "kv_heads": "KV heads per rank (this rank's shard).",
    "head_dim": "Head dimension.",
}


def layout_options(fn: Callable) -> Callable:
    """The cache-layout options (worker, up, trace gen)."""
    from ..wire.layout import CacheLayout

    d = CacheLayout()
    opts = [
        env_option(
            _flag(name),
            type=click.IntRange(1, LAYOUT_MAX[name]),
            default=getattr(d, name),
            envvar=f"ZKV_{name.upper()}",
            help=text,
        )
        for name, text in LAYOUT_HELP.items()
    ]
    opts.append(
        env_option(
            "--dtype",
            type=click.Choice([t.value for t in Dtype]),
            default=d.dtype,
            envvar="ZKV_DTYPE",
            help="Cache element type.",
        )
    )
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
        env_option(
            _flag(name),
            type=click.IntRange(1, LAYOUT_MAX[name]),
            default=None,
            envvar=f"ZKV_RESUME_{name.upper()}",
            help=f"{text} Needs cleared caches.",
        )
        for name, text in helps.items()
    ]
    opts.append(
        env_option(
            "--dtype",
            type=click.Choice([t.value for t in Dtype]),
            default=None,
            envvar="ZKV_RESUME_DTYPE",
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
        env_option(
            "--disk-dir",
            default=None,
            type=click.Path(file_okay=False),
            envvar="ZKV_DISK_DIR",
            help="Directory of this rank's disk tier file (zkv-rankR.disk), reused across restarts for the same "
            "layout; O_DIRECT when the file system takes it, else buffered I/O with fdatasync.",
        ),
        env_option(
            "--disk-blocks",
            type=click.IntRange(1, 2**31 - 1),
            default=4096,
            envvar="ZKV_DISK_BLOCKS",
            help="Blocks the disk tier holds (with --disk-dir); the file is preallocated.",
        ),
    ]
    return stacked(fn, opts)


def store_option(fn: Callable) -> Callable:
    """A rank's keyed store below its CPU tier (worker, up): off unless --store is given."""
    return env_option(
        "--store",
        default=None,
        envvar="ZKV_STORE",
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


#: The CurveZMQ options in ``--help``'s order: parameter -> (a key "file" or a "dir" of keys, help).
CURVE_KEYS = {
    "curve_secret": (
        "file",
        "This party's Curve secret key file (NAME.key_secret, from zkv keygen); turns on CurveZMQ.",
    ),
    "curve_server": ("file", "The broker's public key file (broker.key)."),
    "curve_ranks": (
        "dir",
        "Directory of rank public keys (*.key): allowed on the broker's backend, and to push results to a client.",
    ),
    "curve_clients": ("dir", "Directory of client public keys (*.key) allowed on the frontend."),
}


def curve_options(server: bool = False, client: bool = True) -> Callable:
    """CurveZMQ options (docs/protocol.md §12): off unless --curve-secret is given."""
    names = ["curve_secret"]
    if client:  # the broker's key, to connect to it
        names.append("curve_server")
    if server:  # ranks and clients are authorized separately (docs/protocol.md §12)
        names.append("curve_ranks")
        if not client:  # the broker: client keys for its frontend
            names.append("curve_clients")
    opts = []
    for name in names:
        kind, text = CURVE_KEYS[name]
        path = click.Path(exists=True, file_okay=kind == "file", dir_okay=kind == "dir")
        opts.append(env_option(_flag(name), type=path, default=None, envvar=f"ZKV_{name.upper()}", help=text))
    return lambda fn: stacked(fn, opts)


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
    fn = env_option(
        "--metrics-addr",
        default="127.0.0.1",
        envvar="ZKV_METRICS_ADDR",
        help="Address the /metrics endpoint binds (loopback unless you ask for more).",
    )(fn)
    return env_option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        envvar="ZKV_METRICS_PORT",
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
            env_option(
                "--tier-dir",
                default="/dev/shm",
                envvar="ZKV_TIER_DIR",
                help="Where zkv's CPU tier lives as a file that outlives this process (a restarted rank maps "
                "it again and keeps its blocks; zkv tier list / clean). 'none': in process memory, gone with "
                "the process.",
            ),
            env_option(
                "--tier-digests/--no-tier-digests",
                default=False,
                envvar="ZKV_TIER_DIGESTS",
                help="Also keep a BLAKE2b digest of every CPU-tier block and check it when the block is read. "
                "A torn write is caught without it (each block's header is written last); the digest also "
                "catches bytes changed behind zkv's back, at the cost of hashing every block copied "
                "(several times the copy).",
            ),
        ],
    )


record_option = env_option(
    "--record",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="ZKV_RECORD",
    help="Append every request and task outcome to this trace file (JSON Lines).",
)
