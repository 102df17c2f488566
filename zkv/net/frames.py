"""Receiving and sending whole messages on the hot paths, cheaply.

pyzmq's ``recv_multipart``/``send_multipart`` combine ``zmq.Flag`` enums per
frame, and a drain loop that stops on ``zmq.Again`` builds an exception per
wakeup: together about a third of a small message's cost in Python
(issue 16's profile).  These do the same with plain integer flags and stop
on the socket's ``EVENTS`` instead of an exception.  Same semantics: a
message is all its frames or nothing (ZeroMQ delivers multipart messages
atomically).
"""

from __future__ import annotations

from typing import Iterator

import zmq

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_POLLIN = int(zmq.POLLIN)


def ready_messages(sock: zmq.Socket, limit: int) -> Iterator[list[bytes]]:
    """The messages ``sock`` has queued now (at most ``limit``), each as its
    list of frames; returns without waiting when there are none."""
    recv, get = sock.recv, sock.get
    for _ in range(limit):
        if not int(get(_EVENTS)) & _POLLIN:
            return
        frames = [recv(_NOBLOCK)]
        while get(_RCVMORE):
            frames.append(recv(_NOBLOCK))
        yield frames


def send_message(sock: zmq.Socket, frames: list[bytes], block: bool = False) -> None:
    """Send ``frames`` as one message; raises ``zmq.Again`` (not blocking)
    when the peer's queue is full, unless ``block``."""
    more, last = (_SNDMORE, 0) if block else (_SNDMORE_NOBLOCK, _NOBLOCK)
    send = sock.send
    for frame in frames[:-1]:
        send(frame, more)
    send(frames[-1], last)
