"""What a rank's core asks its loop to do: a frame for the broker, a task or
a cache operation for the executor, an ack to note, a line for the operator.

``ToBroker`` and ``Execute`` are made per task, so they are slotted, not
frozen (a frozen dataclass's ``__init__`` costs ~3 us, six times a plain
one); treat them as values all the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..wire.layout import CacheLayout
from ..wire.vocab import ControlOp


@dataclass(slots=True)
class ToBroker:
    """A frame for the broker; ``done`` frames may travel together, one
    message per wakeup (docs/protocol.md §10.3), everything else alone and
    after the dones before it."""

    frame: bytes
    done: bool = False


@dataclass(slots=True)
class Execute:
    """Run one task on the executor (``refuse`` set: answer failed, no copy)."""

    seq: int
    n: int
    task: int
    reply_to: str
    gen: int
    body: bytes
    refuse: str = ""
    reply_key: str | None = None
    session: int = 0  # the registration session it arrived in
    cpu_gen: int | None = None  # the bus's CPU generation the broker dispatched it at
    batch_results: bool = False  # its client reads several results in one message (docs/protocol.md §10.3)


@dataclass(frozen=True)
class FreeCache:
    keep_cpu: bool


@dataclass(frozen=True)
class AllocateCache:
    layout: CacheLayout


@dataclass(frozen=True)
class Acked:
    """Informational: the rank acknowledged ``op`` at ``epoch`` (for instrumentation)."""

    op: ControlOp
    epoch: int


@dataclass(frozen=True)
class Note:
    """A line for the operator (the worker's log): what the rank did that its flags did not say."""

    text: str


RankAction = Union[ToBroker, Execute, FreeCache, AllocateCache, Acked, Note]
