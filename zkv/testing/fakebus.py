"""In-process stand-in for the bus client, for unit tests and the micro-benchmark only.

It has the methods the prefix cache manager uses (submit / wait / poll and,
like ``zkv.client.Client``, settled) and really copies block contents between two dicts (``gpu`` and ``cpu``: block
id -> any value), so a test can check that data round-trips GPU -> CPU -> GPU.
Outcomes can be scripted per task to exercise every failure path:

* ``ok``        every block copied;
* ``failed``    only the first half copied (one rank did its part, another failed);
* ``cancelled`` / ``rejected``  nothing copied;
* ``timeout``   nothing copied yet, ``wait`` says timeout; ``deliver_late()``
  performs the copy afterwards (a slow rank), so a manager that reused the
  destination blocks would see its data clobbered, and reports the task as
  the real client does: in ``settled()`` (``settles=True``, the default), or,
  for a bus without ``settled`` (``settles=False``), as a late outcome from
  ``poll``;
* ``raise``     ``submit`` raises :class:`FakeBusError` (refused at once).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..wire.outcome import TaskOutcome

SCRIPTABLE_OUTCOMES = ("ok", "failed", "cancelled", "rejected", "timeout", "raise")


class FakeBusError(Exception):
    """The fake bus refused a task at submit."""


@dataclass(frozen=True)
class SubmittedTask:
    task: int
    op: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    outcome: str


class FakeBus:
    """An in-process bus whose outcome for each task is scripted.

    It executes a swap task synchronously inside ``submit`` (copying entries
    between ``gpu`` and ``cpu``) and files its outcome: the next one queued by
    :meth:`script`, else ``default_outcome``.  Control it gives: which outcome
    each task gets, and when a ``timeout`` task's late copy lands
    (:meth:`deliver_late`); ``submitted`` records every task for assertions.
    It runs no broker, ranks or sockets: for the real bus use ``zkv.harness``.
    """

    def __init__(self, block_bytes: int = 1, default_outcome: str = "ok", settles: bool = True) -> None:
        self.gpu: dict[int, object] = {}
        self.cpu: dict[int, object] = {}
        self.block_bytes = block_bytes
        self.default_outcome = default_outcome
        self.submitted: list[SubmittedTask] = []
        self._script: deque[str] = deque()
        self._task_ids = itertools.count(1)
        self._finished: dict[int, TaskOutcome] = {}  # not yet returned by wait/poll
        self._running_late: dict[int, SubmittedTask] = {}  # timed out, copy still to come
        self._settled: list[int] = []  # timed out, copy since landed
        self.settles = settles
        if not settles:
            self.settled = None  # type: ignore[assignment]  # a bus without the method

    def script(self, *outcomes: str) -> None:
        """Outcomes for the next submits, in order; later ones get ``default_outcome``."""
        for outcome in outcomes:
            if outcome not in SCRIPTABLE_OUTCOMES:
                raise ValueError(f"unknown outcome {outcome!r}")
        self._script.extend(outcomes)

    def submit(self, op: str, src: Sequence[int], dst: Sequence[int], timeout: float = 30.0) -> int:
        outcome = self._script.popleft() if self._script else self.default_outcome
        if outcome == "raise":
            raise FakeBusError("bus refused the task")
        task = next(self._task_ids)
        if op not in ("swap_out", "swap_in") or len(src) != len(dst) or len(set(dst)) != len(dst):
            outcome = "rejected"
        record = SubmittedTask(task, op, tuple(src), tuple(dst), outcome)
        self.submitted.append(record)
        if outcome == "timeout":
            self._running_late[task] = record
            return task
        copied = {"ok": len(src), "failed": len(src) // 2}.get(outcome, 0)
        self._copy(record, copied)
        self._finished[task] = TaskOutcome(
            task, outcome, "" if outcome == "ok" else f"scripted {outcome}", copied * self.block_bytes
        )
        return task

    def wait(self, task: int, timeout: float | None = None) -> TaskOutcome:
        if task in self._finished:
            return self._finished.pop(task)
        if task in self._running_late:
            return TaskOutcome(task, "timeout", "no result before the deadline")
        return TaskOutcome(task, "failed", "unknown task")

    def poll(self, timeout: float = 0.0) -> list[TaskOutcome]:
        results = list(self._finished.values())
        self._finished.clear()
        return results

    def settled(self, timeout: float = 0.0) -> list[int]:
        """Timed-out tasks whose late copies have landed since the last call."""
        done, self._settled = self._settled, []
        return done

    def deliver_late(self) -> int:
        """Timed-out tasks finish now: their copies land and ``settled()`` (or,
        with ``settles=False``, ``poll``) reports them."""
        late = list(self._running_late.values())
        self._running_late.clear()
        for record in late:
            self._copy(record, len(record.src))
            if self.settles:
                self._settled.append(record.task)
            else:
                nbytes = len(record.src) * self.block_bytes
                self._finished[record.task] = TaskOutcome(record.task, "ok", "late", nbytes)
        return len(late)

    def clear(self) -> None:
        """The caches were freed: pending copies never happen, contents are gone."""
        if not self.settles:  # the real client never settles a task the clear cut short
            for task in self._running_late:
                self._finished[task] = TaskOutcome(task, "cancelled", "caches cleared")
        self._running_late.clear()
        self.gpu.clear()
        self.cpu.clear()

    def ops(self, op: str) -> list[SubmittedTask]:
        return [record for record in self.submitted if record.op == op]

    def _copy(self, record: SubmittedTask, count: int) -> None:
        source, target = (self.gpu, self.cpu) if record.op == "swap_out" else (self.cpu, self.gpu)
        for src, dst in zip(record.src[:count], record.dst[:count]):
            target[dst] = source.get(src)
