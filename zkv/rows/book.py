"""One book of tier rows for every engine path, driving each task's rows from
submit to settlement.

The prefix cache manager, the transformers ``SwapController`` and the vLLM
offload index each own one (docs/architecture.md, "One book of rows").  What
a row *holds* (a tree node's blocks, a conversation, an offload key) stays
with its owner; the book keeps the moves every owner shares, and refuses the
illegal ones before anything changes.  A row is

- **free**: in the pool (``take`` hands it out, never twice: ``RowPool``);
- **the owner's**: taken, filled or not (``give_back`` returns it);
- **touched** by tasks in flight that write, read or send it (``begin``): a row
  can be the owner's and touched at once;
- **let go**: no owner any more, but a task may still write it (its owner gave
  it back while a task touched it, the task ended without its copies being
  over, or its tier was renewed under it).  It is out of reach, counted as
  used, and back in the pool the moment the last task touching it is over.

A task's end is one rule read off its outcome (``ending.settle_of``): ``ok``
leaves its written rows with the owner (``FILLED``); an end whose copies are
over lets them go at once (``FREED``); any other end keeps them out of reach
until the task *settles* (``HELD``: ``settle`` names it, or ``drain`` says no
task runs any more).  Rows a task only reads are the owner's again at its end
(a late read can spoil only the task's own held writes).  Rows a task *sends*
beyond the book (a ``put`` into a store other engines read) stay the owner's
whatever the end, but stay touched until the task settles: a late send of a
row rewritten meanwhile would store another block's bytes under its name.  Tasks the bus does
not run (an engine's own jobs in flight at a reset: a ``Fence``) end by
``finish`` when their engine says so.

``renew`` starts a tier afresh under the next generation: the owner's rows of
it are gone, while rows a task still touches stay out of reach in the new
pool (a rank that did not lose its memory may still copy into them).

Keys starting or stopping to serve on a row (``serve`` / ``unserve``) are one
fact, taken twice: as ``RowChange``s (what a tier's journal records) and as
``ResidencyEvent``s (what a KV-aware router follows).

Sans-IO: no bus, no clock.  ``check`` verifies the book after any step; a
model-based test (tests/test_row_book.py) drives it with every interleaving of
takes, outcomes, rank deaths, late writes, settlements, drains and renewals."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..wire.outcome import TaskOutcome
from ..wire.vocab import Tier
from .ending import Settle, settle_of
from .pool import RowPool, RowPoolError


class HeldRowError(RowPoolError):
    """Rows the caller does not hold (let go, or never taken), or a task named twice."""


class TaskKind(str, enum.Enum):
    """Who runs a task the book follows."""

    BUS = "bus"  # a zkv task: its outcome says what its rows are (``end``)
    FENCE = "fence"  # an engine's own jobs in flight at a reset: over when the engine says (``finish``)


@dataclass(frozen=True)
class Fence:
    """An engine's jobs in flight at its ``n``-th fenced reset, as one task of the book."""

    n: int


Rows = Mapping[Tier, Iterable[int]]


@dataclass
class Flight:
    """One task the book follows: the rows it writes and reads per tier, what its
    owner gives back beside them once it is over (engine blocks the book does not
    own), and whether it ended with its copies not over (its writes held)."""

    task: Hashable
    kind: TaskKind
    writes: dict[Tier, tuple[int, ...]]
    reads: dict[Tier, tuple[int, ...]]
    payload: Any = None
    ended: bool = False
    sends: dict[Tier, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return sum(len(rows) for rows in self.writes.values())

    def touched(self) -> Iterable[tuple[Tier, int]]:
        for part in (self.writes, self.reads, self.sends):
            for tier, rows in part.items():
                for row in rows:
                    yield tier, row


@dataclass(frozen=True)
class RowChange:
    """Row ``row`` of ``tier`` serves ``key`` from now on; ``row`` None: ``key`` left the tier."""

    tier: Tier
    key: bytes
    row: int | None


@dataclass(frozen=True)
class ResidencyEvent:
    """Keys that arrived on (or left) a tier: what a KV-aware router follows
    (vLLM's ``OffloadingEvent``)."""

    keys: list[bytes]
    tier: Tier
    removed: bool


@dataclass
class _TierRows:
    """One tier: its pool, its generation, how many tasks touch each row, the rows let go."""

    pool: RowPool
    generation: int = 0
    touches: Counter[int] = field(default_factory=Counter)
    let_go: set[int] = field(default_factory=set)


class RowBook:
    """A ``RowPool`` per tier and the tasks that write and read its rows (see the module docstring)."""

    __slots__ = ("_tiers", "_flights", "_changes", "_events", "records")

    def __init__(
        self,
        sizes: Mapping[Tier, int],
        reserved: Mapping[Tier, Iterable[int]] | None = None,
        records: Any = None,
    ) -> None:
        """``records``: whose KV the filled rows hold and the tiers' journals
        (``records.TierRecords``), for tiers that outlive a process; None: nothing written down."""
        reserved = reserved or {}
        self._tiers: dict[Tier, _TierRows] = {
            tier: _TierRows(RowPool(n, tier, reserved.get(tier, ()))) for tier, n in sizes.items()
        }
        self._flights: dict[Hashable, Flight] = {}
        self._changes: list[RowChange] = []
        self._events: list[ResidencyEvent] = []
        self.records = records

    # ------------------------------------------------------------------- rows

    @property
    def pools(self) -> dict[Tier, RowPool]:
        return {tier: t.pool for tier, t in self._tiers.items()}

    def pool(self, tier: Tier) -> RowPool:
        return self._tiers[tier].pool

    def generation(self, tier: Tier) -> int:
        """How many times ``tier`` was renewed: rows taken under another generation are gone."""
        return self._tiers[tier].generation

    def take(self, tier: Tier, count: int) -> list[int]:
        """``count`` free rows of ``tier``, all or nothing (``OutOfBlocksError``)."""
        return self._tiers[tier].pool.alloc(count)

    def claim(self, tier: Tier, rows: Iterable[int]) -> None:
        """Take these free rows of ``tier``, all or nothing (``RowPool.claim``)."""
        self._tiers[tier].pool.claim(rows)

    def give_back(self, tier: Tier, rows: Iterable[int], generation: int | None = None) -> bool:
        """Return rows the owner holds: free now, or once the last task touching them is
        over.  A free, foreign or let-go row raises, changing nothing.  Rows taken under an
        older ``generation`` went with it: nothing changes, False."""
        t = self._tiers[tier]
        if generation is not None and generation != t.generation:
            return False
        rows = list(rows)
        if t.let_go and not t.let_go.isdisjoint(rows):
            held = sorted(t.let_go.intersection(rows))
            raise HeldRowError(f"{tier}: rows {held} are held for a task, not the caller's")
        if not t.touches:
            t.pool.free(rows)
            return True
        t.pool.check_freeable(rows)  # a double free or a foreign id raises before anything changes
        now = [row for row in rows if not t.touches[row]]
        t.let_go.update(row for row in rows if t.touches[row])
        if now:
            t.pool.free(now)
        return True

    def free_rows(self, tier: Tier) -> list[int]:
        """The free rows of ``tier``, the next one handed out last (for checks, not hot paths)."""
        return self._tiers[tier].pool.free_ids()

    # ------------------------------------------------------------------ tasks

    def begin(
        self,
        task: Hashable,
        writes: Rows | None = None,
        reads: Rows | None = None,
        *,
        sends: Rows | None = None,
        payload: Any = None,
        kind: TaskKind = TaskKind.BUS,
    ) -> Flight:
        """``task`` will write ``writes``, read ``reads`` and send ``sends`` beyond the book,
        rows the owner holds.  Raises before anything changes for a task named twice or a
        row the owner does not hold."""
        if task in self._flights:
            raise HeldRowError(f"task {task!r} is already in the book")
        flight = Flight(task, kind, _frozen(writes), _frozen(reads), payload, sends=_frozen(sends))
        for part in (flight.writes, flight.reads, flight.sends):
            for tier, rows in part.items():
                if len(set(rows)) != len(rows):
                    raise HeldRowError(f"{tier}: a row is named twice in one task")
                self._check_owned(self._tiers[tier], rows)
        for tier, row in flight.touched():
            self._tiers[tier].touches[row] += 1
        self._flights[task] = flight
        return flight

    def end(self, task: Hashable, outcome: TaskOutcome) -> Settle:
        """A bus task ended with ``outcome``: its written rows stay the owner's (``FILLED``),
        are freed (``FREED``) or held until it settles (``HELD``), by ``settle_of``."""
        settle = settle_of(outcome)
        self._end(self._flights[task], settle)
        return settle

    def finish(self, task: Hashable, copied: bool) -> Settle:
        """A task whose copies are known to be over (an engine's jobs its engine says are
        done): its written rows stay the owner's if ``copied``, else they are freed."""
        settle = Settle.FILLED if copied else Settle.FREED
        self._end(self._flights[task], settle)
        return settle

    def settle(self, tasks: Iterable[Hashable]) -> list[Flight]:
        """These tasks' copies are over (the bus says they settled): free what their ended
        flights held and return them (tasks still in flight, or unknown, are ignored)."""
        out = []
        for task in tasks:
            flight = self._flights.get(task)
            if flight is not None and flight.ended:
                del self._flights[task]
                self._untouch(flight.writes)
                self._untouch(flight.sends)
                out.append(flight)
        return out

    def drain(self) -> list[Flight]:
        """No task runs any more (every rank acked a pause, and a clear follows): every
        ended flight settles.  Returns them."""
        return self.settle([f.task for f in self._flights.values() if f.ended])

    def flight(self, task: Hashable) -> Flight | None:
        """The task the book follows under this id (in flight, or ended and held), if any."""
        return self._flights.get(task)

    def flights(self, kind: TaskKind | None = None) -> list[Flight]:
        """The tasks the book follows (of ``kind``), in flight or ended and held."""
        return [f for f in self._flights.values() if kind is None or f.kind is kind]

    def touched(self, tier: Tier, row: int) -> bool:
        """Whether a task the book follows still writes or reads ``row`` of ``tier``."""
        return self._tiers[tier].touches[row] > 0

    def is_holding(self, task: Hashable) -> bool:
        """Whether ``task`` ended and still holds rows out of reach."""
        flight = self._flights.get(task)
        return flight is not None and flight.ended

    @property
    def num_held_tasks(self) -> int:
        return sum(1 for f in self._flights.values() if f.ended)

    def held(self) -> dict[Tier, int]:
        """Rows out of the owner's reach, per tier: let go while a task may still write them."""
        return {tier: len(t.let_go) for tier, t in self._tiers.items()}

    def let_go(self, tier: Tier) -> list[int]:
        """The rows of ``tier`` out of the owner's reach, ascending (for checks, not hot paths)."""
        return sorted(self._tiers[tier].let_go)

    def held_entries(self) -> list[Flight]:
        """The ended tasks that hold rows until they settle."""
        return [f for f in self._flights.values() if f.ended]

    # ----------------------------------------------------------- generations

    def renew(self, tier: Tier, num_rows: int, reserved: Iterable[int] = ()) -> None:
        """``tier``'s content is gone (a generation move): a fresh pool of ``num_rows`` under
        the next generation.  The owner's rows of it are gone; rows a task still touches
        stay out of reach (let go) until it is over: a rank that kept its memory may still
        copy into them.  A touched row the new pool has no room for leaves its task."""
        old = self._tiers[tier]
        self._tiers[tier] = _TierRows(RowPool(num_rows, tier, reserved), old.generation + 1)
        self._keep_touched(tier, old.touches)

    def carry(self, old: RowBook) -> None:
        """Start where ``old`` (a fresh book's predecessor: its owner reset) left off: every
        tier's generation moves on, and the rows ``old``'s tasks still touch stay out of
        reach here until those tasks are over."""
        for flight in old._flights.values():
            self._flights[flight.task] = Flight(
                flight.task,
                flight.kind,
                dict(flight.writes),
                dict(flight.reads),
                flight.payload,
                flight.ended,
                dict(flight.sends),
            )
        for tier, t in self._tiers.items():
            was = old._tiers.get(tier)
            t.generation = was.generation + 1 if was is not None else t.generation
            self._keep_touched(tier, was.touches if was is not None else Counter())

    def _keep_touched(self, tier: Tier, touches: Counter[int]) -> None:
        """Rows tasks touched in ``tier``'s previous pool: out of reach in the new one."""
        t = self._tiers[tier]
        pool = t.pool
        keep = [row for row in touches if 0 <= row < pool.num_blocks and row not in pool.reserved]
        pool.claim(keep)
        t.let_go.update(keep)
        t.touches.update({row: touches[row] for row in keep})
        kept = set(keep)
        for flight in list(self._flights.values()):
            for part in (flight.writes, flight.reads, flight.sends):
                if tier in part:
                    part[tier] = tuple(row for row in part[tier] if row in kept)
            if flight.ended and not any(flight.writes.values()):
                del self._flights[flight.task]  # it held nothing the new pool has: nothing left to settle

    # ------------------------------------------------------------------- keys

    def serve(self, tier: Tier, key: bytes, row: int) -> None:
        """``key`` is served from ``row`` of ``tier`` from now on."""
        self._said(tier, [(key, row)], removed=False)

    def unserve(self, tier: Tier, keys: Iterable[bytes]) -> None:
        """``keys`` are served from ``tier`` no more."""
        self._said(tier, [(key, None) for key in keys], removed=True)

    def serve_all(self, tier: Tier, pairs: Iterable[tuple[bytes, int]]) -> None:
        """``serve`` for many (key, row) pairs at once: one event."""
        self._said(tier, list(pairs), removed=False)

    def take_changes(self) -> list[RowChange]:
        """The row changes since the last call, in order (a journal's records)."""
        changes, self._changes = self._changes, []
        return changes

    def record(self, rows_of: Any, keys: int) -> None:
        """Hand the row changes since the last call to the book's records (its journals),
        before anything that could reuse a row; without records they are dropped.
        ``rows_of(tier)``: what each tier serves now, ``keys`` how many (for compaction)."""
        changes = self.take_changes()
        if self.records is not None:
            self.records.append(changes, rows_of, keys)

    def take_events(self) -> list[ResidencyEvent]:
        """The residency events since the last call (what a router follows)."""
        events, self._events = self._events, []
        return events

    # ----------------------------------------------------------------- check

    def check(self) -> None:
        """Raise AssertionError unless every pool is consistent, every task's rows are
        counted once per task, and every row let go is in use and still touched."""
        counted: dict[Tier, Counter[int]] = {tier: Counter() for tier in self._tiers}
        for flight in self._flights.values():
            if flight.ended and flight.reads:
                raise AssertionError(f"ended task {flight.task!r} still reads rows")
            for tier, row in flight.touched():
                counted[tier][row] += 1
            for tier, rows in flight.writes.items():
                if flight.ended and not self._tiers[tier].let_go.issuperset(rows):
                    raise AssertionError(f"{tier}: rows task {flight.task!r} holds are the owner's again")
        for tier, t in self._tiers.items():
            t.pool.check()
            if +t.touches != counted[tier]:
                raise AssertionError(f"{tier}: the touch counts and the tasks disagree")
            if any(not t.pool.is_allocated(row) for row in (*t.touches, *t.let_go)):
                raise AssertionError(f"{tier}: a touched or let-go row is free")
            if any(not t.touches[row] for row in t.let_go):
                raise AssertionError(f"{tier}: a row let go that no task touches was not freed")

    # --------------------------------------------------------------- private

    @staticmethod
    def _check_owned(t: _TierRows, rows: Iterable[int]) -> None:
        for row in rows:
            if not t.pool.is_allocated(row) or row in t.let_go:
                raise HeldRowError(f"{t.pool.tier}: row {row!r} is not held by the caller (free, foreign or let go)")

    def _end(self, flight: Flight, settle: Settle) -> None:
        if flight.ended:
            raise HeldRowError(f"task {flight.task!r} already ended")
        self._untouch(flight.reads)
        flight.reads = {}
        if settle.lets_go:
            for tier, rows in flight.writes.items():
                self._tiers[tier].let_go.update(rows)
        if settle is Settle.HELD:
            flight.ended = True
            return
        del self._flights[flight.task]
        self._untouch(flight.writes)
        self._untouch(flight.sends)

    def _untouch(self, part: Mapping[Tier, tuple[int, ...]]) -> None:
        """A task stops touching these rows: those let go that no task touches now are free."""
        for tier, rows in part.items():
            t = self._tiers[tier]
            freed = []
            for row in rows:
                t.touches[row] -= 1
                if not t.touches[row]:
                    del t.touches[row]
                    if row in t.let_go:
                        t.let_go.discard(row)
                        freed.append(row)
            if freed:
                t.pool.free(freed)

    def _said(self, tier: Tier, pairs: list[tuple[bytes, int | None]], removed: bool) -> None:
        if not pairs:
            return
        self._changes.extend(RowChange(tier, key, row) for key, row in pairs)
        self._events.append(ResidencyEvent([key for key, _ in pairs], tier, removed))


def _frozen(rows: Rows | None) -> dict[Tier, tuple[int, ...]]:
    return {tier: tuple(ids) for tier, ids in (rows or {}).items() if ids}
