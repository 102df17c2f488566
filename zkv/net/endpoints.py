"""Where the bus listens, and how every zkv socket is configured.

The embedded default is ``ipc://`` in a private runtime directory (loopback
only: docs/protocol.md §12).  Socket options live here once so that no socket in zkv is
made without linger 0, bounded high-water marks and a frame-size cap.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq

from ..wire.protocol import MAX_FRAME_BYTES

# libzmq drops a peer whose frame exceeds this; the application cap
# (MAX_FRAME_BYTES, answered with a too_large error) sits below it.
ZMQ_MAXMSGSIZE = 4 * MAX_FRAME_BYTES
HWM = 100_000


def runtime_dir() -> Path:
    """``$ZKV_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/zkv``, else ``/tmp/zkv-$UID``."""
    env = os.environ.get("ZKV_RUNTIME_DIR")
    if env:
        path = Path(env)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "zkv"
    else:
        path = Path(tempfile.gettempdir()) / f"zkv-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class Endpoints:
    """The three addresses a broker binds and ranks / clients connect to."""

    frontend: str
    backend: str
    control: str

    @classmethod
    def in_dir(cls, directory: str | Path) -> "Endpoints":
        d = Path(directory)
        return cls(f"ipc://{d}/frontend.sock", f"ipc://{d}/backend.sock", f"ipc://{d}/control.sock")

    @classmethod
    def default(cls) -> "Endpoints":
        return cls.in_dir(runtime_dir())


def make_socket(ctx: zmq.Context, kind: int, *, router: bool = False) -> zmq.Socket:
    """A socket with the options every zkv socket shares."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAXMSGSIZE)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if kind in (zmq.DEALER, zmq.ROUTER, zmq.PUSH):
        # ZMTP heartbeats drop dead TCP peers; application liveness covers the rest.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    if router:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises, never vanishes
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes over its identity
    return sock


class StopSignal:
    """An inproc PULL a loop polls beside its sockets, so that ``stop()`` from
    any thread wakes it at once instead of the loop polling a flag."""

    _ids = itertools.count()

    def __init__(self, ctx: zmq.Context, name: str):
        self.ctx = ctx
        # Unguessable: nothing outside this process may name it (docs/architecture.md, "Strangers").
        self.address = f"inproc://zkv-stop-{name}-{next(self._ids)}-{secrets.token_hex(8)}"
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.address)

    def stop(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        sock.send(b"stop")
        sock.close()


def check_bind_address(address: str, allow_remote: bool, secure: bool = False) -> None:
    """Refuse to listen beyond this host without CurveZMQ unless told to (docs/protocol.md §12)."""
    if address.startswith(("ipc://", "inproc://")) or allow_remote or secure:
        return
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
            return
        raise ValueError(
            f"refusing to bind {address}: not loopback; configure CurveZMQ (--curve-secret, "
            f"--curve-ranks and --curve-clients) or pass --allow-remote to listen unauthenticated"
        )
    raise ValueError(f"unsupported address {address!r}: use ipc://PATH or tcp://HOST:PORT")


def check_connect_address(address: str) -> None:
    """Refuse an address a client cannot connect to, naming the forms that work
    (libzmq's own answer to ``host:port`` is a bare ``Invalid argument``)."""
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536:
            return
    raise ValueError(f"{address!r} is not a broker address: use ipc://PATH or tcp://HOST:PORT")


def certainly_absent(address: str, timeout: float = 1.0) -> str | None:
    """Why nothing can be listening at ``address``, when that is certain at
    once (no ``ipc://`` socket file, a socket file nobody listens on, a
    refused TCP connection); None when something may answer.  A client that
    connects to such an address would otherwise wait its whole timeout."""
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if path.startswith("@"):  # Linux abstract namespace: no file to look at
            return None
        if not os.path.exists(path):
            return f"no socket file {path}"
        family, target = socket.AF_UNIX, path
    elif address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        try:
            info = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as err:
            return f"cannot resolve {host}: {getattr(err, 'strerror', None) or err}"
        family, target = info[0][0], info[0][4]  # type: ignore[assignment]
    else:
        return None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(target)
        except (ConnectionRefusedError, FileNotFoundError):
            return "nothing listens there (connection refused)"
        except OSError:
            return None  # a timeout or a network error: maybe a slow path, let the client try
    return None
