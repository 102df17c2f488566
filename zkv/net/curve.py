"""CurveZMQ for a bus reachable from other hosts (docs/protocol.md §12).

Every party has a Curve keypair.  The broker is the Curve server of its three
sockets and authenticates peers through ZAP, with the ZAP domain enforced
(without a ZAP handler a CURVE server accepts any key;
CURVE_ALLOW_ANY encrypts but does not authenticate).  Ranks and clients are
authorized separately, each against its own directory of public keys and its
own ZAP domain: the backend and control sockets let in rank keys only, the
frontend client keys only, so a rank key cannot submit and a client key cannot
register.  Results flow the other way (rank PUSH -> client PULL), so a client's
PULL is a Curve server too, letting in rank keys only; the client's public key
travels in each task as ``reply_key``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

# zmq.auth (and its ThreadAuthenticator, which imports asyncio: ~0.1 s) load
# when a key is read or a server authenticates, never on a rank's or a
# client's start without Curve.

RANKS_DOMAIN = "zkv-ranks"  # broker backend + control: rank keys
CLIENTS_DOMAIN = "zkv-clients"  # broker frontend: client keys
RESULTS_DOMAIN = "zkv-results"  # a client's result PULL: rank keys


def generate_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (mode 0600)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    import zmq.auth

    old = os.umask(0o077)  # secret files would otherwise get the process umask
    try:
        public, secret = zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_keypair(secret_file: str | Path) -> tuple[bytes, bytes]:
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key (pass the .key_secret file)")
    return public, secret


def load_public(public_file: str | Path) -> bytes:
    import zmq.auth

    return zmq.auth.load_certificate(str(public_file))[0]


@dataclass(frozen=True)
class Curve:
    """One party's Curve settings: its own secret file, plus the broker's
    public key (clients and ranks) and the directories of authorized public
    keys per role: ``ranks_dir`` (the broker; a client, for its result PULL)
    and ``clients_dir`` (the broker)."""

    secret_file: str
    server_public_file: str | None = None
    ranks_dir: str | None = None
    clients_dir: str | None = None

    def keys(self) -> tuple[bytes, bytes]:
        return load_keypair(self.secret_file)

    def make_server(self, sock: zmq.Socket, domain: str) -> None:
        """Curve server with ZAP enforced: only keys authorized for ``domain`` get in."""
        public, secret = self.keys()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_server = True
        sock.zap_domain = domain.encode()
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

    def broker_domains(self) -> dict[str, str]:
        """The broker's ZAP domains and the directory each authorizes."""
        if not self.ranks_dir or not self.clients_dir:
            raise ValueError(
                "a Curve broker needs --curve-ranks (rank public keys) and --curve-clients (client public keys)"
            )
        return {RANKS_DOMAIN: self.ranks_dir, CLIENTS_DOMAIN: self.clients_dir}

    def results_domains(self) -> dict[str, str]:
        """A client's ZAP domain for its result PULL: only ranks may push."""
        if not self.ranks_dir:
            raise ValueError("a Curve client needs --curve-ranks: the rank public keys its result socket lets in")
        return {RESULTS_DOMAIN: self.ranks_dir}

    def start_authenticator(self, ctx: zmq.Context, domains: dict[str, str]) -> "SharedAuthenticator":
        """The ZAP handler of ``ctx`` (one per Context: ZAP binds a fixed
        inproc address), started on first use, serving ``domains``; release() it when done."""
        return SharedAuthenticator.acquire(ctx, domains)


class SharedAuthenticator:
    """One ZAP handler per Context, shared by every Curve server in it (several
    clients' PULL sockets, say).  It lives as long as the Context: libzmq
    unbinds ``inproc://zeromq.zap.01`` asynchronously, so stopping it and
    starting another races ("Address already in use")."""

    _by_ctx: dict[int, "SharedAuthenticator"] = {}
    _lock = threading.Lock()  # clients of one Context may start and close on several threads (a fleet's)

    def __init__(self, ctx: zmq.Context):
        from zmq.auth.thread import ThreadAuthenticator

        self.key = id(ctx)
        self.domains: dict[str, str] = {}
        self.users = 0
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()

    @classmethod
    def acquire(cls, ctx: zmq.Context, domains: dict[str, str]) -> "SharedAuthenticator":
        with cls._lock:
            shared = cls._by_ctx.get(id(ctx))
            if shared is None:
                shared = cls._by_ctx[id(ctx)] = cls(ctx)
            for domain, directory in domains.items():
                if shared.domains.get(domain) == directory:
                    continue
                if domain in shared.domains and shared.users:
                    raise ValueError(f"this Context already authorizes {domain} keys from {shared.domains[domain]}")
                shared.auth.configure_curve(domain=domain, location=directory)
                shared.domains[domain] = directory
            shared.users += 1
            return shared

    def stop(self) -> None:
        """Release this user's hold (the handler itself stays with the Context)."""
        with self._lock:
            self.users -= 1


def security_mismatch(address: str, curve: Curve | None, timeout: float = 3.0) -> str | None:
    """Why a ZMTP handshake with the peer at ``address`` fails for lack of matching
    security, as a client with ``curve`` would connect: the peer speaks CurveZMQ and
    this client has no keys, or the reverse (libzmq says so: a mechanism mismatch).
    None when the handshake succeeds, fails another way (a wrong key is silence) or
    nothing answers within ``timeout`` (a loaded broker may take a while; a peer that
    answers at all answers the handshake first).  A probe socket of its own, closed at once."""
    from .handshakes import HandshakeProbe, mismatch_reason

    probe = HandshakeProbe(zmq.Context.instance(), address, curve)
    try:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not probe.socket.poll(int(left * 1000)):
                return None
            verdict = probe.read()
            if verdict is not None:
                return mismatch_reason(curve is not None) if verdict.mismatch else None
    finally:
        probe.close()
