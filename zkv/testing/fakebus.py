"""In-process stand-in for the bus client, for unit tests and the micro-benchmark only.

It has the methods the prefix cache manager uses (submit / wait / poll and,
like ``zkv.client.Client``, settled) and really copies block contents between
three dicts (``gpu``, ``cpu`` and ``disk``: block id -> any value) for the
ops ``swap_out`` (gpu -> cpu), ``swap_in`` (cpu -> gpu), ``spill`` (cpu ->
disk) and ``load`` (disk -> cpu), so a test can check that data round-trips
through every tier.  Outcomes can be scripted per task to exercise every
failure path:

* ``ok``        every block copied;
* ``failed``    only the first half copied (one rank did its part, another failed);
* ``cancelled`` / ``rejected``  nothing copied;
* ``timeout``   nothing copied yet, ``wait`` says timeout; ``deliver_late()``
  performs the copy afterwards (a slow rank), so a manager that reused the
  destination blocks would see its data clobbered, and reports the task as
  the real client does: in ``settled()`` (``settles=True``, the default), or,
  for a bus without ``settled`` (``settles=False``), as a late outcome from
  ``poll``;
* ``died``      ``failed`` because a rank died while another was still copying:
  no rank reported, nothing copied yet, and ``deliver_late()`` lands the
  surviving rank's copy and settles it, as for a timeout;
* ``raise``     ``submit`` raises :class:`FakeBusError` (refused at once).

Any of them may end in ``+gen`` or ``+cpu_gen``: the bus moves to a new
generation while the task runs, after its copy (``move_gen`` /
``move_cpu_gen``).  A ``load`` naming a disk block marked lost
(``lose_disk``) fails as a real rank's does (``disk_lost``, docs/protocol.md
§6.2) and leaves garbage in its destination.

Generations, as ``zkv.client.Client`` names them: ``gen`` and ``cpu_gen``
are None (a bus that tells none) until a test sets them.  ``move_gen()``
loses the GPU content, ``move_cpu_gen()`` every tier's (docs/protocol.md
§8.2); a timed-out task of the old generation never lands (a rank refuses a
task of another generation) and is reported settled.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from ..wire.moves import MOVES
from ..wire.outcome import TaskOutcome
from ..wire.vocab import Op, Outcome

SCRIPTABLE_OUTCOMES = (*Outcome, "raise", "died")
#: scripted outcomes whose copy lands later (``deliver_late``): the task ends before every rank reported
_LATE = {Outcome.TIMEOUT: Outcome.TIMEOUT, "died": Outcome.FAILED}
GEN_MOVES = ("gen", "cpu_gen")
#: op -> (source tier, destination tier)
OPS = {op: (move.source, move.dest) for op, move in MOVES.items() if not move.keyed}
#: what a lost generation's memory and a failed load's destination hold: never a block's data
GARBAGE = ("garbage",)


class FakeBusError(Exception):
    """The fake bus refused a task at submit."""


class SubmittedTask(NamedTuple):
    """One task as submitted, with the outcome it was given."""

    task: int
    op: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    outcome: str


class FakeBus:
    """An in-process bus whose outcome for each task is scripted.

    It executes a task synchronously inside ``submit`` (copying entries
    between its tiers' dicts) and files its outcome: the next one queued by
    :meth:`script`, else ``default_outcome``.  Control it gives: which outcome
    each task gets, when a ``timeout`` task's late copy lands
    (:meth:`deliver_late`), generation moves, lost disk blocks;
    ``submitted`` records every task for assertions.  It runs no broker,
    ranks or sockets: for the real bus use ``zkv.harness``.
    """

    def __init__(self, block_bytes: int = 1, default_outcome: str = Outcome.OK, settles: bool = True) -> None:
        self.gpu: dict[int, object] = {}
        self.cpu: dict[int, object] = {}
        self.disk: dict[int, object] = {}
        self.gen: int | None = None
        self.cpu_gen: int | None = None
        self.lost_disk: set[int] = set()  # disk blocks whose digest will not check
        self.block_bytes = block_bytes
        self.default_outcome = default_outcome
        self.submitted: list[SubmittedTask] = []
        self._script: deque[str] = deque()
        self._op_script: dict[str, deque[str]] = {}
        self._task_ids = itertools.count(1)
        self._finished: dict[int, TaskOutcome] = {}  # not yet returned by wait/poll
        self._running_late: dict[int, SubmittedTask] = {}  # timed out, copy still to come
        self._settled: list[int] = []  # timed out, copy since landed
        self.settles = settles
        if not settles:
            self.settled = None  # type: ignore[assignment]  # a bus without the method

    def script(self, *outcomes: str, op: str | None = None) -> None:
        """Outcomes for the next submits (of ``op`` only, if given: those come
        first), in order; later ones get ``default_outcome``."""
        for outcome in outcomes:
            base, _, move = outcome.partition("+")
            if base not in SCRIPTABLE_OUTCOMES or (move and move not in GEN_MOVES):
                raise ValueError(f"unknown outcome {outcome!r}")
        (self._script if op is None else self._op_script.setdefault(op, deque())).extend(outcomes)

    def _next_outcome(self, op: str) -> str:
        for queue in (self._op_script.get(op), self._script):
            if queue:
                return queue.popleft()
        return self.default_outcome

    def submit(self, op: str, src: Sequence[int], dst: Sequence[int], timeout: float = 30.0) -> int:
        outcome, _, move = self._next_outcome(op).partition("+")
        if outcome == "raise":
            raise FakeBusError("bus refused the task")
        task = next(self._task_ids)
        if op not in OPS or len(src) != len(dst) or len(set(dst)) != len(dst):
            outcome = Outcome.REJECTED
        reason = "" if outcome == Outcome.OK else f"scripted {outcome}"
        lost = sorted({b for b in src if b in self.lost_disk or b not in self.disk}) if op == Op.LOAD else []
        if lost and outcome == Outcome.OK:
            outcome, reason = Outcome.FAILED, f"disk_lost: disk blocks {lost} did not check"
        record = SubmittedTask(task, op, tuple(src), tuple(dst), _LATE.get(outcome, outcome))
        self.submitted.append(record)
        if outcome in _LATE:
            self._running_late[task] = record
            if outcome == "died":
                self._finished[task] = TaskOutcome(task, Outcome.FAILED, "scripted: a rank died")
        else:
            copied = len(src) if outcome == Outcome.OK else len(src) // 2 if outcome == Outcome.FAILED else 0
            self._copy(record, copied)
            reported = outcome in (Outcome.OK, Outcome.FAILED)  # every rank said so; the others never ran
            self._finished[task] = TaskOutcome(
                task, outcome, reason, copied * self.block_bytes, never_ran=not reported, every_rank_reported=reported
            )
        if move == "gen":
            self.move_gen()
        elif move == "cpu_gen":
            self.move_cpu_gen()
        return task

    def wait(self, task: int, timeout: float | None = None) -> TaskOutcome:
        if task in self._finished:
            return self._finished.pop(task)
        if task in self._running_late:
            return TaskOutcome(task, Outcome.TIMEOUT, "no result before the deadline")
        return TaskOutcome(task, Outcome.FAILED, "unknown task")

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
            self._copy(record, len(record.src))  # a failed one's surviving rank copies its whole shard
            self._report_late(record, Outcome.OK, "late", len(record.src) * self.block_bytes)
        return len(late)

    def move_gen(self) -> None:
        """The GPU content is gone (a rank restarted, its CPU tier kept): ``gen`` moves, ``cpu_gen`` stays."""
        self.gen = (self.gen or 0) + 1
        _scribble(self.gpu)
        self._end_late("cache generation moved")

    def move_cpu_gen(self) -> None:
        """Every tier's content is gone (a rank restarted without its CPU tier): both generations move."""
        self.cpu_gen = (self.cpu_gen or 0) + 1
        self.move_gen()
        _scribble(self.cpu)
        _scribble(self.disk)

    def lose_disk(self, block: int) -> None:
        """The disk block's digest will not check: a ``load`` of it fails ``disk_lost``."""
        self.lost_disk.add(block)

    def clear(self) -> None:
        """The caches were freed: pending copies never happen, contents are gone."""
        if not self.settles:  # the real client never settles a task the clear cut short
            for task in self._running_late:
                self._finished[task] = TaskOutcome(task, Outcome.CANCELLED, "caches cleared")
        self._running_late.clear()
        self.gpu.clear()
        self.cpu.clear()
        self.disk.clear()
        self.lost_disk.clear()

    def ops(self, op: str) -> list[SubmittedTask]:
        return [record for record in self.submitted if record.op == op]

    def _end_late(self, reason: str) -> None:
        """Tasks of the old generation still running never copy: a rank refuses them."""
        late = list(self._running_late.values())
        self._running_late.clear()
        for record in late:
            self._report_late(record, Outcome.FAILED, reason, 0)

    def _report_late(self, record: SubmittedTask, outcome: str, reason: str, nbytes: int) -> None:
        if self.settles:
            self._settled.append(record.task)
        else:
            self._finished[record.task] = TaskOutcome(record.task, outcome, reason, nbytes)

    def _copy(self, record: SubmittedTask, count: int) -> None:
        if record.op not in OPS:
            return
        source_tier, target_tier = OPS[record.op]
        source, target = getattr(self, source_tier), getattr(self, target_tier)
        if record.op != Op.LOAD:
            written = record.dst[:count]
            target.update(zip(written, map(source.get, record.src[:count])))
            if target is self.disk:
                self.lost_disk.difference_update(written)  # written anew, with a fresh digest
            return
        for src, dst in zip(record.src[:count], record.dst[:count]):  # a load: lost blocks land as garbage
            target[dst] = GARBAGE if src in self.lost_disk else source.get(src)
        if record.outcome == Outcome.FAILED:
            for dst in record.dst[count:]:
                target[dst] = GARBAGE  # a failed load's destination holds undefined bytes


def _scribble(tier: dict[int, object]) -> None:
    """Memory of a lost generation: every block holds something, never its data."""
    for block in tier:
        tier[block] = GARBAGE
