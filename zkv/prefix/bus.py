"""What the prefix cache manager needs of the bus: ``BusLike`` (the
``zkv.client.Client`` has all of it; ``zkv.testing.FakeBus`` is its test double)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

SWAP_OPS = ("swap_out", "swap_in")


class TaskOutcomeLike(Protocol):
    task: int
    outcome: str
    reason: str
    bytes: int


class BusLike(Protocol):
    """What the manager needs from the bus (``zkv.client.Client`` has all of it).

    Optional: ``settled() -> list[int]``, the ids of tasks that ended ``timeout``
    and whose every rank has reported since (their copies are over).  When the
    bus has it, the manager releases quarantined blocks through it and never
    calls ``poll`` (which would hand it outcomes of tasks other code awaits).
    Without it, the manager polls for late outcomes of its timed-out tasks.
    """

    def submit(self, op: str, src: Sequence[int], dst: Sequence[int], timeout: float = 30.0) -> int: ...

    def wait(self, task: int, timeout: float | None = None) -> TaskOutcomeLike: ...

    def poll(self, timeout: float = 0.0) -> list[TaskOutcomeLike]: ...
