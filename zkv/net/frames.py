"""Receiving and sending whole messages on the hot paths, cheaply.

pyzmq's ``recv_multipart``/``send_multipart`` combine ``zmq.Flag`` enums per
frame (~1.7 us each); these do the same with plain integer flags.  Same
semantics: a message is all its frames or nothing (ZeroMQ delivers
multipart messages atomically).

``raw_send`` is the backend's ``send``: pyzmq's Python ``Socket.send`` only
adds the DRAFT ``routing_id``/``group`` arguments in front of it, and costs
~0.25 us a frame (a 1-block task sends about ten frames over its path).
"""

from __future__ import annotations

from typing import Hashable, Iterator

import zmq
from zmq.backend import Socket as _BackendSocket

raw_send = _BackendSocket.send  # raw_send(sock, frame, flags): a frame, no DRAFT arguments
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_SNDMORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_PROBES = 3  # messages of a drain preceded by a zmq_poll (see ready_messages)


def ready_messages(sock: zmq.Socket, limit: int) -> Iterator[list[bytes]]:
    """The messages ``sock`` has queued now (at most ``limit``), each as its
    list of frames; returns without waiting when there are none.

    Call it when a poll said ``sock`` is readable.  Knowing when to stop
    costs: a ``zmq.Again`` from an empty socket ~7.5 us, a ``zmq_poll`` of
    the socket alone ~2.5 us.  A wakeup with one task in flight brings one
    message, a loaded one tens, so it asks ``zmq_poll`` before the next few
    and lets the exception end a long drain."""
    recv, probe = sock.recv, [(sock, _POLLIN)]
    for i in range(limit):
        if 0 < i <= _PROBES and not zmq.zmq_poll(probe, 0):
            return
        try:
            frame = recv(_NOBLOCK, False)  # a Frame knows whether more follow; get(RCVMORE) makes an enum
        except zmq.Again:
            return
        frames = [frame.bytes]
        while frame.more:
            frame = recv(_NOBLOCK, False)
            frames.append(frame.bytes)
        yield frames


def send_message(sock: zmq.Socket, frames: list[bytes], block: bool = False) -> None:
    """Send ``frames`` as one message; raises ``zmq.Again`` (not blocking)
    when the peer's queue is full, unless ``block``."""
    more, last = (_SNDMORE, 0) if block else (_SNDMORE_NOBLOCK, _NOBLOCK)
    for frame in frames[:-1]:
        raw_send(sock, frame, more)
    raw_send(sock, frames[-1], last)


class Coalescer:
    """Messages to each peer gathered into one until flushed (a
    message costs both ends ~10 us of Python and I/O thread, its frames a
    fraction of that).  ``add`` returns the gathered frames once a peer has
    ``limit`` messages waiting (send them now); ``take``/``drain`` empty it.
    The loop that owns it flushes at the end of every wakeup and before any
    other message to the same peer, so nothing is reordered or held back."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pending: dict[Hashable, list[bytes]] = {}
        self.counts: dict[Hashable, int] = {}

    def add(self, peer: Hashable, frames: list[bytes]) -> list[bytes] | None:
        gathered = self.pending.setdefault(peer, [])
        gathered += frames
        count = self.counts.get(peer, 0) + 1
        if count >= self.limit:
            self.counts.pop(peer, None)
            return self.pending.pop(peer)
        self.counts[peer] = count
        return None

    def take(self, peer: Hashable) -> list[bytes] | None:
        self.counts.pop(peer, None)
        return self.pending.pop(peer, None)

    def drain(self) -> list[tuple[Hashable, list[bytes]]]:
        out = list(self.pending.items())
        self.pending.clear()
        self.counts.clear()
        return out

    def __bool__(self) -> bool:
        return bool(self.pending)
