"""The client's book of open tasks, with no sockets (sans-IO).

Per-rank results (from the PULL socket) and broker outcomes (from the DEALER)
are folded here into exactly one :class:`TaskOutcome` per task.  Whatever
arrives for a task that already ended (a late rank result after a timeout, a
result from before a clear) is counted and ignored, never reported twice.

A move to a new cache generation cancels exactly the tasks that ran at an
older one (docs/protocol.md §7.4): a task's generation is the ``gen`` its
results carry, so a task that ran at the new generation ends with its real
outcome, however late the client learned of the move.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field

from ..wire.messages import Result
from ..wire.outcome import RankFold, TaskOutcome
from ..wire.vocab import Outcome


@dataclass(slots=True)
class _Open:
    task: int
    submitted: float
    deadline: float
    floor: int  # the client's generation at submit: the task cannot have run at an older one
    gen: int | None = None  # the generation its results say it ran at
    fold: RankFold | None = None
    per_rank: dict[int, dict] = field(default_factory=dict)


_MAX_TIMED_OUT = 100_000
_PER_RANK_FIELDS = ("reason", "bytes", "elapsed_us", "digests", "gen")  # kept per rank, after the outcome


class ResultBook:
    """Open tasks, their deadlines, and the one-outcome-per-task rule.

    A task that ended before every rank reported (``timeout``; ``failed`` because
    a rank died while the others still copied; ``cancelled`` by a generation
    move heard first) may still be copying on a slow rank.  Its outcome stays,
    but the book keeps watching for the missing ranks' late results; when all
    of them arrived the task is *settled*: no rank will write its blocks any
    more, so a cache manager may reuse them (``zkv.rows.ending``).
    """

    def __init__(self) -> None:
        self.open: dict[int, _Open] = {}
        self.deadlines: list[tuple[float, int]] = []
        self.gen = 0
        self.gen_known = False  # a new client takes the first generation it hears of
        # The CPU tier's generation (docs/protocol.md §8.2): None while unknown,
        # and after a move of ``gen`` heard without one (then CPU content may be gone too).
        self.cpu_gen: int | None = None
        self.moved: list[TaskOutcome] = []  # tasks ended because the bus moved to a new generation
        self.counters: collections.Counter[str] = collections.Counter()
        self.unsettled: collections.OrderedDict[int, _Open] = collections.OrderedDict()
        self.settled: list[int] = []

    def add(self, task: int, now: float, timeout: float) -> None:
        self.open[task] = _Open(task, now, now + timeout, self.gen)
        heapq.heappush(self.deadlines, (now + timeout, task))

    def shorten(self, task: int, deadline: float) -> None:
        """Bring a task's deadline forward (a caller that will wait no longer)."""
        entry = self.open[task]
        if deadline < entry.deadline:
            entry.deadline = deadline
            heapq.heappush(self.deadlines, (deadline, task))

    def on_result(self, msg: Result, now: float) -> TaskOutcome | None:
        """A rank's result; returns the task's outcome once it is final."""
        entry = self.open.get(msg.task)
        if entry is None:
            self.counters["late_results"] += 1
            self._late(msg)
            return None
        if msg.gen < entry.floor:  # older than the generation the task was submitted at: not its result
            self.counters["stale_results"] += 1
            return None
        if msg.gen < self.gen:
            # It ran at a generation the bus has left since: what it copied is gone.
            self.counters["old_gen_results"] += 1
            reason = f"cache generation moved from {msg.gen} to {self.gen}: the task ran at generation {msg.gen}"
            self.moved.append(self._close(entry, Outcome.CANCELLED, reason, now))
            return None
        if msg.gen > self.gen:  # news of a move: it ends the open tasks that ran before it
            reason = "the bus moved to a new cache generation (see zkv status)"
            self.moved += self.learn_gen(msg.gen, reason, now, msg.cpu_gen)
            if msg.task not in self.open:  # this task had a result of an older generation too
                return None
        self.learn_cpu_gen(False, msg.cpu_gen)
        self.gen_known = True
        entry.gen = msg.gen
        if entry.fold is None:
            entry.fold = RankFold(msg.world)
        rank = msg.rank
        if not entry.fold.add(rank, msg.outcome, msg.reason or "", msg.bytes or 0):
            self.counters["duplicate_results"] += 1
            return None
        said = entry.per_rank[rank] = {"outcome": msg.outcome}  # the fields the result carried, nil left out
        for key in _PER_RANK_FIELDS:
            value = getattr(msg, key)
            if value is not None:
                said[key] = value
        if not entry.fold.complete:
            return None
        return self._close(entry, entry.fold.outcome, entry.fold.reason, now)

    def _late(self, msg: Result) -> None:
        entry = self.unsettled.get(msg.task)
        if entry is None:
            return
        if entry.fold is None:
            entry.fold = RankFold(msg.world)
        entry.fold.add(msg.rank, msg.outcome)
        if entry.fold.complete:
            del self.unsettled[msg.task]
            self._settle(msg.task)

    def _settle(self, task: int) -> None:
        self.settled.append(task)
        if len(self.settled) > _MAX_TIMED_OUT:  # a caller that never asks
            del self.settled[: len(self.settled) - _MAX_TIMED_OUT]

    def take_settled(self) -> list[int]:
        """Timed-out tasks whose every rank has since reported: their copies are over."""
        done, self.settled = self.settled, []
        return done

    def learn_cpu_gen(self, gen_moved: bool, cpu_gen: int | None) -> None:
        """Take the CPU generation a message names; a move of ``gen`` heard
        without one makes it unknown (the CPU content may be gone with it)."""
        if cpu_gen is not None:
            self.cpu_gen = max(cpu_gen, self.cpu_gen if self.cpu_gen is not None else 0)
        elif gen_moved:
            self.cpu_gen = None

    def learn_gen(self, gen: int, reason: str, now: float, cpu_gen: int | None = None) -> list[TaskOutcome]:
        """The bus is at ``gen``: if that is newer, every open task that ran at
        an older generation ends ``cancelled`` (what it copied is gone).  An
        open task with no result yet stays open: its own results say which
        generation it ran at (``on_result``).  ``cpu_gen``: the CPU
        generation the same message names, if it names one."""
        known, self.gen_known = self.gen_known, True
        self.learn_cpu_gen(gen > self.gen, cpu_gen)
        if gen <= self.gen:
            return []
        old, self.gen = self.gen, gen
        if not known:
            return []
        self.counters["gen_changes"] += 1
        reason = f"cache generation moved from {old} to {gen}: {reason}"
        older = [entry for entry in self.open.values() if entry.gen is not None and entry.gen < gen]
        return [self._close(entry, Outcome.CANCELLED, reason, now) for entry in older]

    def on_outcome(
        self, task: int, outcome: str, reason: str, now: float, gen: int | None = None, ran: bool | None = None
    ) -> TaskOutcome | None:
        """A final outcome decided by the broker (rejected, cancelled, expired
        in its queue, rank died); ``gen`` (the broker's generation) may tell the
        book the bus moved on; ``ran=False``: it was never dispatched."""
        done = self._book_outcome(task, outcome, reason, now, ran is False)  # this task's own word first
        if gen is not None and gen > self.gen:
            self.moved += self.learn_gen(gen, reason or "the bus moved to a new cache generation", now)
        return done

    def _book_outcome(self, task: int, outcome: str, reason: str, now: float, never_ran: bool) -> TaskOutcome | None:
        entry = self.open.get(task)
        if entry is None:
            self.counters["late_outcomes"] += 1
            # Rejected, cancelled or expired in the broker's queue: it never
            # reached a rank, so nothing will copy.  (A rank that "died" may be
            # only stopped and still finish a copy it started: no settling.)
            unsent = never_ran or outcome in (Outcome.REJECTED, Outcome.CANCELLED)
            if unsent and self.unsettled.pop(task, None) is not None:
                self._settle(task)
            return None
        return self._close(entry, outcome, reason, now, never_ran)

    def expire(self, now: float) -> list[TaskOutcome]:
        """Close every task past its deadline with ``timeout``, naming missing ranks."""
        done = []
        while self.deadlines and self.deadlines[0][0] <= now:
            _, task = heapq.heappop(self.deadlines)
            entry = self.open.get(task)
            if entry is None or entry.deadline > now:
                continue
            if entry.fold is None:
                reason = "no rank answered before the deadline"
            else:
                reason = f"no result from ranks {sorted(entry.fold.waiting)} before the deadline"
            done.append(self._close(entry, Outcome.TIMEOUT, reason, now))
        return done

    def cleared(self, gen: int, reason: str, now: float, cpu_gen: int | None = None) -> list[TaskOutcome]:
        """This client's own clear reply names ``gen``.  Every task still open
        was submitted before the clear request, on the same connection, so at
        an older generation: if ``gen`` is news, they all end ``cancelled``."""
        self.gen_known = True
        self.learn_cpu_gen(gen > self.gen, cpu_gen)
        if gen <= self.gen:
            return []
        self.gen = gen
        self.counters["gen_changes"] += 1
        return self.cancel_all(reason, now)

    def cancel_all(self, reason: str, now: float) -> list[TaskOutcome]:
        """After a clear: whatever those tasks copied is gone with the caches."""
        self.unsettled.clear()  # their blocks are gone with the caches too
        self.settled.clear()
        # A clear follows a pause every rank acked with nothing in flight: no copy runs any more.
        return [self._close(entry, Outcome.CANCELLED, reason, now, drained=True) for entry in list(self.open.values())]

    def next_deadline(self) -> float | None:
        while self.deadlines and self.deadlines[0][1] not in self.open:
            heapq.heappop(self.deadlines)
        return self.deadlines[0][0] if self.deadlines else None

    def _close(
        self, entry: _Open, outcome: str, reason: str, now: float, never_ran: bool = False, drained: bool = False
    ) -> TaskOutcome:
        """End ``entry`` with ``outcome``.  One that ended before every rank reported (a
        timeout, a rank that died, a generation move) is watched for the missing ranks'
        late results: when they are all in, the task *settles* (``take_settled``)."""
        del self.open[entry.task]
        self.counters[outcome] += 1
        fold = entry.fold
        nbytes = fold.bytes if fold is not None else 0
        elapsed = now - entry.submitted
        never = never_ran and not entry.per_rank
        reported = drained or (fold is not None and fold.complete)
        done = TaskOutcome(entry.task, outcome, reason, nbytes, elapsed, entry.per_rank, never, reported)
        if not done.copies_over:
            self.unsettled[entry.task] = entry
            if len(self.unsettled) > _MAX_TIMED_OUT:
                self.unsettled.popitem(last=False)
        return done
