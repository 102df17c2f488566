"""The bus as every owner of a ``RowBook`` sees it (the prefix manager, the
engines' controllers): ``Bus``, what their tasks need of ``zkv.client.Client``
(``engines.tp_bus.TPBus`` and ``zkv.testing.FakeBus`` are the others), and
``ControlBus``, a ``Bus`` that also runs the clear cycle.  It lives beside the
book because the book's rule reads what the bus says of a task (its
``TaskOutcome``, one type everywhere) and settles what ``settled()`` names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..wire.moves import ROW_MOVES
from ..wire.outcome import TaskOutcome
from ..wire.replies import ControlReply, StatusReply

#: the ops the prefix manager submits: the tier moves, GPU <-> CPU swaps and CPU <-> disk spills and loads
#: (``wire/moves.py``, docs/protocol.md §6)
SWAP_OPS = ROW_MOVES


class Bus(Protocol):
    """Submit a swap, wait for its outcome, and learn which timed-out tasks have settled.

    A bus may also name its generations as ``gen`` and ``cpu_gen`` attributes
    (``zkv.client.Client`` does; ``loss.py``): then an owner drops what the
    bus lost.

    ``settled()``: the ids of tasks that ended before every rank reported (a
    timeout, a rank that died) and whose missing ranks have reported since,
    so their copies are over (``RowBook.settle``).  The prefix manager also
    serves a bus whose ``settled`` is None (an older client, a test double) by
    polling it for late outcomes (``prefix/swaps.py``).
    """

    def submit(self, op: str, src: Sequence[int], dst: Sequence[int], timeout: float = 30.0) -> int: ...

    def wait(self, task: int, timeout: float | None = None) -> TaskOutcome: ...

    def settled(self, timeout: float = 0.0) -> list[int]: ...


class ControlBus(Bus, Protocol):
    """A ``Bus`` with the control requests the clear cycle sends (``zkv.client.Client`` has them)."""

    def pause(self, timeout: float = 30.0) -> ControlReply: ...

    def clear(self, keep_cpu: bool = False, timeout: float = 30.0, weights: str | None = None) -> ControlReply: ...

    def resume(self, layout: dict | None = None, timeout: float = 30.0) -> ControlReply: ...

    def status(self, timeout: float | None = None) -> StatusReply: ...


def settled_tasks(bus: Any, wait: float = 0.0) -> list[int]:
    """The tasks ``bus`` says settled since it was last asked (``Bus.settled``), or, for a bus
    without that method (an older client, a test double), the tasks of its late outcomes;
    none when the bus cannot answer (gone, closing): the rows stay held, asked again later."""
    settled = getattr(bus, "settled", None)
    try:
        if callable(settled):
            return list(settled(wait))
        return [result.task for result in bus.poll(wait)]
    except Exception:  # noqa: BLE001 - a bus that cannot say keeps the rows held, never frees them
        return []
