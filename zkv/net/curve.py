"""CurveZMQ for a bus reachable from other hosts (DESIGN §10).

Every party has a Curve keypair.  The broker is the Curve server of its three
sockets and authenticates peers through ZAP against a directory of authorized
public keys, with the ZAP domain enforced (FIELD-NOTES: without a ZAP handler
a CURVE server accepts any key; CURVE_ALLOW_ANY encrypts but does not
authenticate).  Results flow the other way (rank PUSH -> client PULL), so a
client's PULL is a Curve server too, authenticating ranks against the same
directory; the client's public key travels in each task as ``reply_key``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "zkv"


def generate_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (mode 0600)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)  # secret files would otherwise get the process umask
    try:
        public, secret = zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_keypair(secret_file: str | Path) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key (pass the .key_secret file)")
    return public, secret


def load_public(public_file: str | Path) -> bytes:
    return zmq.auth.load_certificate(str(public_file))[0]


@dataclass(frozen=True)
class Curve:
    """One party's Curve settings: its own secret file, plus the broker's
    public key (clients and ranks) or the authorized-keys directory (servers)."""

    secret_file: str
    server_public_file: str | None = None
    authorized_dir: str | None = None

    def keys(self) -> tuple[bytes, bytes]:
        return load_keypair(self.secret_file)

    def make_server(self, sock: zmq.Socket) -> None:
        """Curve server with ZAP enforced: only authorized keys get in."""
        public, secret = self.keys()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def make_client(self, sock: zmq.Socket, server_key: bytes | None = None) -> None:
        public, secret = self.keys()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        if server_key is None:
            if self.server_public_file is None:
                raise ValueError("a Curve client needs the server's public key file")
            server_key = load_public(self.server_public_file)
        sock.curve_serverkey = server_key

    def public_key(self) -> str:
        return self.keys()[0].decode()

    def start_authenticator(self, ctx: zmq.Context) -> "SharedAuthenticator":
        """The ZAP handler of ``ctx`` (one per Context: ZAP binds a fixed
        inproc address), started on first use; release() it when done."""
        if not self.authorized_dir:
            raise ValueError("a Curve server needs a directory of authorized public keys")
        return SharedAuthenticator.acquire(ctx, self.authorized_dir)


class SharedAuthenticator:
    """One ZAP handler per Context, shared by every Curve server in it (several
    clients' PULL sockets, say).  It lives as long as the Context: libzmq
    unbinds ``inproc://zeromq.zap.01`` asynchronously, so stopping it and
    starting another races ("Address already in use")."""

    _by_ctx: dict[int, "SharedAuthenticator"] = {}

    def __init__(self, ctx: zmq.Context, authorized_dir: str):
        self.key = id(ctx)
        self.authorized_dir = authorized_dir
        self.users = 0
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve(domain=ZAP_DOMAIN, location=authorized_dir)

    @classmethod
    def acquire(cls, ctx: zmq.Context, authorized_dir: str) -> "SharedAuthenticator":
        shared = cls._by_ctx.get(id(ctx))
        if shared is None:
            shared = cls._by_ctx[id(ctx)] = cls(ctx, authorized_dir)
        elif shared.authorized_dir != authorized_dir:
            if shared.users:
                raise ValueError(f"this Context already authorizes keys from {shared.authorized_dir}")
            shared.auth.configure_curve(domain=ZAP_DOMAIN, location=authorized_dir)
            shared.authorized_dir = authorized_dir
        shared.users += 1
        return shared

    def stop(self) -> None:
        """Release this user's hold (the handler itself stays with the Context)."""
        self.users -= 1
