"""The words of the wire: the protocol version and the closed sets of values
a field may take (docs/protocol.md §2, §4).

Each set is a ``str`` enum: a member equals, hashes and msgpack-encodes as its
string, so code may compare a decoded field (a plain ``str``) with a member,
and a member written into a frame gives the bytes the string gives.
"""

from __future__ import annotations

import enum

VERSION = 1


class _Word(str, enum.Enum):
    """A wire word: ``str()`` and ``format()`` are the value itself, as for
    ``enum.StrEnum`` (which would also do, on Python 3.11 and later)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ControlOp(_Word):
    """The ``op`` of ``control`` and ``welcome``: what the ranks must do
    (``ack``, and the client's requests, name the last three)."""

    RUN = "run"
    PAUSE = "pause"
    CLEAR = "clear"
    RESUME = "resume"


class Outcome(_Word):
    """How a task ended; a rank's ``done`` and ``result`` say ``ok`` or ``failed`` only."""

    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    TIMEOUT = "timeout"


class RankOutcome(_Word):
    """How a task ended on one rank (``done`` and ``result``): an ``Outcome``'s
    first two words, equal to them (``RankOutcome.OK == Outcome.OK``)."""

    OK = "ok"
    FAILED = "failed"


class BusState(_Word):
    """What the bus is doing: ``status`` and a control reply say it as ``state``
    (the broker's transitions between them: ``zkv/broker/state.py``)."""

    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    CLEARING = "clearing"
    CLEARED = "cleared"
    RESUMING = "resuming"


class TaskState(_Word):
    """What a task was when its client asked to cancel it (``cancel``'s reply, ``state``)."""

    QUEUED = "queued"  # cancelled: it never ran
    DISPATCHED = "dispatched"  # it runs to its own outcome
    DONE = "done"  # it had ended
    UNKNOWN = "unknown"  # no such task of this client


class Op(_Word):
    """What a task body asks of every rank."""

    SWAP_OUT = "swap_out"
    SWAP_IN = "swap_in"
    FILL = "fill"
    CHECKSUM = "checksum"
    SPILL = "spill"  # CPU tier -> disk tier
    LOAD = "load"  # disk tier -> CPU tier
    PUT = "put"  # CPU tier -> the keyed store (values by name, shared beyond this engine)
    GET = "get"  # the keyed store -> CPU tier


class Tier(_Word):
    """The memory a ``fill`` or ``checksum`` names."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    STORE = "store"  # the keyed store: a host tier or a distributed one, named by keys, not ids


class Dtype(_Word):
    """A cache element type; ``itemsize`` is its size in bytes (the torch
    dtype it stands for is the rank's to choose, never the wire's)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {Dtype.BF16: 2, Dtype.FP16: 2, Dtype.FP32: 4}

RANK_OUTCOMES = tuple(RankOutcome)  # what one rank reports of a task
CLIENT_OPS = (ControlOp.PAUSE, ControlOp.CLEAR, ControlOp.RESUME)  # what a client asks, and a rank acks
