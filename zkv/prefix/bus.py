"""The bus as prefix/ and engines/ see it: ``Bus``, what their swaps need of
``zkv.client.Client`` (``engines.tp_bus.TPBus`` and ``zkv.testing.FakeBus``
are the others), and ``ControlBus``, a ``Bus`` that also runs the clear cycle
(``cycle.py``).  Outcomes are the wire's ``TaskOutcome``, one type everywhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..wire.moves import MOVES
from ..wire.outcome import TaskOutcome
from ..wire.replies import ControlReply, StatusReply

#: the ops the prefix manager submits: the tier moves, GPU <-> CPU swaps and CPU <-> disk spills and loads
#: (``wire/moves.py``, docs/protocol.md §6)
SWAP_OPS = tuple(MOVES)


class Bus(Protocol):
    """Submit a swap, wait for its outcome, and learn which timed-out tasks have settled.

    A bus may also name its generations as ``gen`` and ``cpu_gen`` attributes
    (``zkv.client.Client`` does; ``generations.py``): then the manager drops
    what the bus lost.

    ``settled()``: the ids of tasks that ended ``timeout`` and whose every rank
    has reported since, so their copies are over.  The prefix manager also
    serves a bus whose ``settled`` is None (an older client, a test double) by
    polling it for late outcomes (``swaps.py``).
    """

    def submit(self, op: str, src: Sequence[int], dst: Sequence[int], timeout: float = 30.0) -> int: ...

    def wait(self, task: int, timeout: float | None = None) -> TaskOutcome: ...

    def settled(self, timeout: float = 0.0) -> list[int]: ...


class ControlBus(Bus, Protocol):
    """A ``Bus`` with the control requests the clear cycle sends (``zkv.client.Client`` has them)."""

    def pause(self, timeout: float = 30.0) -> ControlReply: ...

    def clear(self, keep_cpu: bool = False, timeout: float = 30.0) -> ControlReply: ...

    def resume(self, layout: dict | None = None, timeout: float = 30.0) -> ControlReply: ...

    def status(self, timeout: float | None = None) -> StatusReply: ...
