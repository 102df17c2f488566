"""One book of tier rows for every engine path: which rows of each tier are
free, which are in use, and which a task that may still write them holds out
of reach until its outcome is known.

The prefix cache manager, the transformers ``SwapController`` and the vLLM
offload index each own one (docs/architecture.md, "One book of rows").  What
a row *holds* (a tree node's blocks, a conversation, an offload key) stays
with its owner; the book keeps the moves every owner shares, and refuses the
illegal ones before anything changes:

- ``take`` hands out free rows (never one twice: ``RowPool``);
- ``give_back`` returns rows in use (a double free or a foreign id raises);
- ``hold`` parks rows in use under a task that may still write them (a
  timeout, a failure no rank reported): they stay in use, counted as held,
  until ``settle`` names the task (its outcome is known: freed),
  ``release_held`` says no task runs any more (a drained bus: all freed), or
  ``renew`` replaces their tier (a generation move: the rows went with it);
- ``renew`` starts a tier afresh under the next generation; ``generation``
  tells callers which one their rows were taken under, and ``give_back``
  under an older one changes nothing (the rows went with their generation);
- ``announce`` queues residency events (what a KV-aware router follows);
  owners emit them here, and ``take_events`` hands them over.

Sans-IO: no bus, no clock.  ``check`` verifies the book after any step; a
model-based test drives it with every interleaving of takes, task outcomes,
clears and generation moves."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..wire.vocab import Outcome, Tier
from .pool import RowPool, RowPoolError


class HeldRowError(RowPoolError):
    """Rows handed to ``hold`` that are not in use, already held, or a task held twice."""


@dataclass(frozen=True)
class Held:
    """What one task that may still write holds: its rows per tier, and what its owner
    gives back beside them when it settles (engine blocks the book does not own)."""

    task: Hashable
    rows: Mapping[str, tuple[int, ...]]
    payload: Any = None

    @property
    def num_rows(self) -> int:
        return sum(len(rows) for rows in self.rows.values())


@dataclass(frozen=True)
class ResidencyEvent:
    """Keys that arrived on (or left) a tier: what a KV-aware router follows
    (vLLM's ``OffloadingEvent``)."""

    keys: list[bytes]
    tier: Tier
    removed: bool


def may_write_late(outcome: str, ran: bool | None, ranks_reported: bool = True) -> bool:
    """Whether a task that ended with ``outcome`` may still write its destination rows.

    A timeout may (a slow rank copies late), and so may a failure that no rank
    reported (``ranks_reported`` False: a rank died or the client gave up, and
    the others are not known to have stopped); unless the broker said the
    task was never dispatched (``ran`` False).  ``ok``, a failure the ranks
    reported, ``cancelled`` and ``rejected`` write nothing more."""
    if ran is False:
        return False
    return outcome == Outcome.TIMEOUT or (outcome == Outcome.FAILED and not ranks_reported)


class RowBook:
    """A ``RowPool`` per tier, the rows held for tasks that may still write them, and
    the residency events owners announce (see the module docstring)."""

    __slots__ = ("pools", "_generations", "_held", "_held_rows", "_events")

    def __init__(self, sizes: Mapping[Tier, int], reserved: Mapping[Tier, Iterable[int]] | None = None) -> None:
        reserved = reserved or {}
        self.pools: dict[str, RowPool] = {tier: RowPool(n, tier, reserved.get(tier, ())) for tier, n in sizes.items()}
        self._generations: dict[str, int] = dict.fromkeys(sizes, 0)
        self._held: dict[Hashable, Held] = {}
        self._held_rows: dict[str, set[int]] = {tier: set() for tier in sizes}
        self._events: list[ResidencyEvent] = []

    # ------------------------------------------------------------------- rows

    def pool(self, tier: str) -> RowPool:
        return self.pools[tier]

    def generation(self, tier: str) -> int:
        """How many times ``tier`` was renewed: rows taken under another generation are gone."""
        return self._generations[tier]

    def take(self, tier: str, count: int) -> list[int]:
        """``count`` free rows of ``tier``, all or nothing (``OutOfBlocksError``)."""
        return self.pools[tier].alloc(count)

    def claim(self, tier: str, rows: Iterable[int]) -> None:
        """Take these free rows of ``tier``, all or nothing (``RowPool.claim``)."""
        self.pools[tier].claim(rows)

    def give_back(self, tier: str, rows: Iterable[int], generation: int | None = None) -> bool:
        """Free rows in use (a double free or a foreign id raises, changing nothing).  Rows
        taken under an older ``generation`` went with it: nothing changes, False."""
        if generation is not None and generation != self._generations[tier]:
            return False
        rows = list(rows)
        held = self._held_rows[tier]
        if held and not held.isdisjoint(rows):
            raise HeldRowError(f"{tier}: rows {sorted(held.intersection(rows))} are held for a task, not the caller's")
        self.pools[tier].free(rows)
        return True

    def free_rows(self, tier: str) -> list[int]:
        """The free rows of ``tier``, the next one handed out last (for checks, not hot paths)."""
        return self.pools[tier].free_ids()

    # ------------------------------------------------------- late writers

    def hold(self, task: Hashable, rows: Mapping[Tier, Iterable[int]], payload: Any = None) -> Held:
        """Keep rows in use out of reach: ``task`` may still write them."""
        if task in self._held:
            raise HeldRowError(f"task {task!r} already holds rows")
        frozen: dict[str, tuple[int, ...]] = {tier: tuple(ids) for tier, ids in rows.items() if ids}
        for tier, ids in frozen.items():
            pool, held = self.pools[tier], self._held_rows[tier]
            for row in ids:
                if not pool.is_allocated(row) or row in held:
                    raise HeldRowError(f"{tier}: row {row!r} is not in use by the caller (free, foreign or held)")
            if len(set(ids)) != len(ids):
                raise HeldRowError(f"{tier}: a row is named twice in one hold")
        for tier, ids in frozen.items():
            self._held_rows[tier].update(ids)
        entry = Held(task, frozen, payload)
        self._held[task] = entry
        return entry

    def settle(self, tasks: Iterable[Hashable]) -> list[Held]:
        """The outcomes of ``tasks`` are known: free what they held (tasks holding nothing
        are ignored) and return their entries."""
        out = []
        for task in tasks:
            entry = self._held.pop(task, None)
            if entry is not None:
                self._free_held(entry)
                out.append(entry)
        return out

    def pass_on(self, task: Hashable, to: Hashable) -> None:
        """What ``task`` holds is held for ``to`` from now on (``task``'s part is over, ``to``
        may still write the rows)."""
        if to in self._held:
            raise HeldRowError(f"task {to!r} already holds rows")
        entry = self._held.pop(task)
        self._held[to] = Held(to, entry.rows, entry.payload)

    def release_held(self) -> list[Held]:
        """No task runs any more (a drained bus): free every held row; return the entries."""
        return self.settle(list(self._held))

    def held(self) -> dict[str, int]:
        """Rows held for late tasks, per tier."""
        return {tier: len(rows) for tier, rows in self._held_rows.items()}

    def held_entries(self) -> list[Held]:
        return list(self._held.values())

    @property
    def num_held_tasks(self) -> int:
        return len(self._held)

    def is_holding(self, task: Hashable) -> bool:
        return task in self._held

    def _free_held(self, entry: Held) -> None:
        for tier, ids in entry.rows.items():
            self._held_rows[tier].difference_update(ids)
            self.pools[tier].free(ids)

    # ----------------------------------------------------------- generations

    def renew(self, tier: str, num_rows: int, reserved: Iterable[int] = ()) -> int:
        """``tier``'s rows are gone (a generation move): a fresh pool under the next
        generation; held rows of it go with the old one (a task holding nothing else
        is forgotten).  Returns how many tasks were forgotten."""
        self.pools[tier] = RowPool(num_rows, tier, reserved)
        self._generations[tier] += 1
        self._held_rows[tier] = set()
        forgotten = 0
        for task, entry in list(self._held.items()):
            if tier not in entry.rows:
                continue
            rest = {t: ids for t, ids in entry.rows.items() if t != tier}
            if rest:
                self._held[task] = Held(task, rest, entry.payload)
            else:
                del self._held[task]
                forgotten += 1
        return forgotten

    # ---------------------------------------------------------------- events

    def announce(self, tier: Tier, keys: list[bytes], removed: bool) -> None:
        if keys:
            self._events.append(ResidencyEvent(keys, tier, removed))

    def take_events(self) -> list[ResidencyEvent]:
        events, self._events = self._events, []
        return events

    # ----------------------------------------------------------------- check

    def check(self) -> None:
        """Raise AssertionError unless every pool is consistent and every held row is in
        use, held once, by exactly one task."""
        for tier, pool in self.pools.items():
            pool.check()
            by_task: set[int] = set()
            for entry in self._held.values():
                ids = entry.rows.get(tier, ())
                if not by_task.isdisjoint(ids):
                    raise AssertionError(f"{tier}: a row is held by two tasks")
                by_task.update(ids)
            if by_task != self._held_rows[tier]:
                raise AssertionError(f"{tier}: the held rows and the tasks holding them disagree")
            if any(not pool.is_allocated(row) for row in by_task):
                raise AssertionError(f"{tier}: a held row is free")
