"""A connecting socket's ZMTP handshakes, watched until one succeeds.

A peer whose security differs (CurveZMQ on one end only) fails every
handshake with a mechanism mismatch, and nothing else on the socket says so:
sends queue, receives stay silent, and a client would learn it only when its
timeout ends.  libzmq reports each failed handshake on the socket's monitor;
``HandshakeWatch`` reads those reports, so that a client can say why at once
and a rank can say why it waits."""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "HANDSHAKE_FAILED_NO_DETAIL",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "HANDSHAKE_FAILED_PROTOCOL",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "HANDSHAKE_FAILED_AUTH",
}


def mismatch_reason(has_keys: bool) -> str:
    """What a mechanism mismatch means for a client that has CurveZMQ keys or none."""
    if has_keys:
        return "the broker does not speak CurveZMQ and this client does"
    return "the broker speaks CurveZMQ and this client has no keys"


class HandshakeWatch:
    """The handshakes of ``sock`` (a socket that connects) as libzmq reports them:
    ``failures`` (the event names seen), ``mismatch`` (one failed for a security
    mechanism the peer does not share), ``refused`` (the peer refused this end's key),
    ``succeeded``.  Poll ``socket`` for news,
    then ``read()``; ``close()`` when nothing more is to be learnt."""

    def __init__(self, sock: zmq.Socket):
        self._watched = sock
        self.socket: zmq.Socket = sock.get_monitor_socket(int(sum(_FAILED)) | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.failures = ""
        self.mismatch = False
        self.refused = False  # the peer's ZAP handler refused this end's key
        self.succeeded = False

    def read(self) -> None:
        """Take every report waiting on the monitor."""
        while self.socket.poll(0):
            event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded = True
                continue
            name = _FAILED.get(zmq.Event(kind), str(kind))
            if name not in self.failures:
                self.failures = ", ".join(filter(None, [self.failures, name]))
            if (
                kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            ):
                self.mismatch = True
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = True

    def close(self) -> None:
        self._watched.disable_monitor()
        self.socket.close(linger=0)


class HandshakeProbe:
    """A socket of its own that connects to ``address`` as a client with ``curve`` would,
    only to learn whether its handshake goes through (it sends nothing).  Poll
    ``socket``, then ``read()``: None while no handshake ended (nothing listens yet),
    else its ``HandshakeWatch``.  A socket's monitor is its owner's to take: a client
    that wants to know about its own DEALER without taking that asks a probe."""

    def __init__(self, ctx: zmq.Context, address: str, curve: Any = None):
        self._probe = ctx.socket(zmq.DEALER)
        self._probe.linger = 0
        self.watch = HandshakeWatch(self._probe)
        self.socket = self.watch.socket
        try:
            if curve is not None:
                curve.make_client(self._probe)
            self._probe.connect(address)
        except BaseException:
            self.close()
            raise

    def read(self) -> HandshakeWatch | None:
        """The verdict once there is one: matched, mismatched, or this end's key refused.  A
        handshake that failed with no detail is no verdict: the peer may close the connection
        before this end reads its greeting (a mismatch then shows as a broken pipe), and
        libzmq tries again."""
        self.watch.read()
        watch = self.watch
        return watch if watch.succeeded or watch.mismatch or watch.refused else None

    def close(self) -> None:
        self.watch.close()
        self._probe.close(linger=0)


__all__ = ["HandshakeProbe", "HandshakeWatch", "mismatch_reason"]
