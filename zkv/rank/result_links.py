"""A rank's PUSH sockets to the result addresses clients choose.

A client picks its result address, so the peer behind one address changes
over time, and not always to one with the same security settings.  A PUSH
that once failed a handshake there (a client run without its Curve keys on a
fixed ``ZKV_RESULT_ADDR``) is not trusted again: libzmq drops the pipe, every
later send on that socket finds no peer, and results to the correctly keyed
client that comes back on the same address would be lost for good.  Each
socket is therefore watched through its monitor; a failed handshake closes
it, and the next send connects a fresh one.  A look at the monitor is a
system call, so a link busy with results looks at most every
``LOOK_EVERY_S`` (a handshake failure costs at most that much of a stream
of results; a link idle longer looks before its next send).  What cannot be
handed over is counted (``undeliverable``) and logged, rate limited, never
silent.

A client that said it reads several results in one message (``batch_results``,
docs/protocol.md §10.3) gets the results of one wakeup of the I/O thread
together: one message of result frames costs the rank, the I/O threads and
the client about what one frame does, and under load a wakeup runs tens of
tasks.
"""

from __future__ import annotations

import collections
import logging
import time

import zmq

from ..net.curve import Curve
from ..net.endpoints import make_socket
from ..net.frames import raw_send, send_message
from ..net.reply_address import connect_result
from ..wire import bounds
from ..wire import protocol as P

log = logging.getLogger("zkv.worker")

MAX_RESULT_SOCKETS = 64  # PUSH sockets kept per thread, least recently used closed first
LOG_EVERY_S = 5.0  # at most one warning per address and kind in this time
LOOK_EVERY_S = 0.02  # a link's monitor is read at most this often (a getsockopt is a system call)
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: zmq.Flag arithmetic costs a microsecond a send (net/frames.py)
_POLLIN = int(zmq.POLLIN)
_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class _Link:
    """One PUSH and the monitor that tells whether its peer turned it away."""

    __slots__ = ("sock", "monitor", "next_look")

    def __init__(self, sock: zmq.Socket, monitor: zmq.Socket):
        self.sock = sock
        self.monitor = monitor
        self.next_look = 0.0

    def refused(self, now: float) -> bool:
        """True when a handshake failed since the last look (drains the events);
        False without a look until ``LOOK_EVERY_S`` after the last one."""
        if now < self.next_look:
            return False
        self.next_look = now + LOOK_EVERY_S
        failed = False
        while int(self.monitor.getsockopt(zmq.EVENTS)) & _POLLIN:
            frames = self.monitor.recv_multipart(_NOBLOCK)
            event = int.from_bytes(frames[0][:2], "little")
            failed = failed or bool(event & _FAILED_EVENTS)
        return failed

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class ResultSenders:
    """One thread's PUSH sockets to clients' result addresses.

    A client that went away never blocks the rank: sends are NOBLOCK and what
    cannot be queued is counted as undeliverable.  ZMQ sockets are never shared
    between threads: each thread owns its own ``ResultSenders``.

    ``holds``: results for a client that reads them in batches wait in
    ``held`` until ``flush`` (the owner's loop flushes at the end of every
    wakeup, before anything else it sends); a link holding ``MAX_BATCH``
    sends them at once.  Without it every result goes out as it comes."""

    def __init__(self, ctx: zmq.Context, curve: Curve | None, stats: collections.Counter[str], holds: bool = False):
        self.ctx = ctx
        self.curve = curve
        self.stats = stats
        self.holds = holds
        self.links: collections.OrderedDict[tuple[str, str | None], _Link] = collections.OrderedDict()
        self.held: dict[tuple[str, str | None], list[bytes]] = {}
        self._logged: dict[tuple[str, str], float] = {}

    def post(self, address: str, key: str | None, frame: bytes, batch: bool) -> None:
        """Send one result frame, or hold it for its link's next message when
        ``batch`` (its client reads batches) and these senders hold."""
        if not (batch and self.holds):
            if self.held and (address, key) in self.held:  # what waits for this link goes first: order kept
                self.send(address, key, self.held.pop((address, key)))
            self.send(address, key, [frame])
            return
        held = self.held.get((address, key))
        if held is None:
            held = self.held[(address, key)] = []
        held.append(frame)
        if len(held) >= bounds.MAX_BATCH:
            self.send(address, key, self.held.pop((address, key)))

    def flush(self) -> None:
        """Send every held batch, each as one message."""
        held, self.held = self.held, {}
        for (address, key), frames in held.items():
            self.send(address, key, frames)

    def send(self, address: str, key: str | None, frames: list[bytes]) -> None:
        """Send ``frames`` (whole result frames, at most ``MAX_BATCH``) as one message."""
        link = self.links.get((address, key))
        if link is not None and link.refused(time.monotonic()):
            self.stats["result_reconnects"] += 1
            self._warn(address, "handshake", "a peer there refused the handshake (other Curve settings?); reconnecting")
            del self.links[(address, key)]
            link.close()
            link = None
        if link is None:
            link = self._connect(address, key)
            if link is None:
                self._undeliverable(address, len(frames), "cannot connect")
                return
        else:
            self.links.move_to_end((address, key))
        try:
            if len(frames) == 1:
                raw_send(link.sock, frames[0], _NOBLOCK)
            else:  # refused whole or queued whole: ZeroMQ checks its high-water mark at a message's first frame
                send_message(link.sock, frames)
        except zmq.Again:
            self._undeliverable(address, len(frames), "no peer accepted it (gone, or its queue is full)")

    def _connect(self, address: str, key: str | None) -> _Link | None:
        if not P.is_result_address(address):  # checked at the broker too: never connect inproc://
            return None
        if len(self.links) >= MAX_RESULT_SOCKETS:
            _, old = self.links.popitem(last=False)
            old.close()
        sock = make_socket(self.ctx, zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        try:
            if self.curve is not None:
                if not key:
                    raise ValueError("a secured rank sends results only to Curve clients (no reply_key)")
                self.curve.make_client(sock, server_key=key.encode())
            monitor = sock.get_monitor_socket(_FAILED_EVENTS)
            connect_result(sock, address)  # an IPv6 address needs ZMQ_IPV6
        except (zmq.ZMQError, ValueError) as err:
            self._warn(address, "connect", f"cannot send results there: {err}")
            sock.close(linger=0)
            return None
        link = self.links[(address, key)] = _Link(sock, monitor)
        return link

    def _undeliverable(self, address: str, count: int, why: str) -> None:
        self.stats["undeliverable"] += count
        self._warn(address, "undeliverable", f"{count} result(s) not delivered: {why}")

    def _warn(self, address: str, kind: str, text: str) -> None:
        now = time.monotonic()
        if now - self._logged.get((address, kind), -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[(address, kind)] = now
            if len(self._logged) > 4 * MAX_RESULT_SOCKETS:
                self._logged.clear()
            log.warning("results to %s: %s (undeliverable so far: %d)", address, text, self.stats["undeliverable"])

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
