"""What zkv holds for one vLLM engine, as its scheduler sees it: which offload
key lives in which CPU or disk row, in which state, in LRU order.

Sans-IO (docs/engine-vllm.md, "What holds"): the manager (``manager.py``)
turns vLLM's calls and zkv's task outcomes into calls here, and the answers
into tasks.  The rows are the ``RowBook``'s: it drives every task's rows from
submit to settlement (our spills and loads as bus tasks, with the one rule
of ``zkv.rows.ending``; vLLM's own jobs in flight at a fenced reset as a
``Fence``), so a key forgotten while a task still touches its rows simply
gives them back and the book frees them once no task can write them.  The
rules it keeps, checked after every step by a model-based test:

- a row belongs to at most one key per tier, or is free, or is out of reach
  while a task may still touch it after its key was forgotten: nothing is
  handed out twice, and a row given back twice raises;
- a key is a hit only while its CPU row holds exactly its bytes: its store
  (or its load from disk) ended ``ok``, and no load from that row failed since;
- a row being written (a store, a load from disk, a spill's disk row) or read
  (a load into vLLM, a spill's CPU row) is never evicted or handed out.

A CPU row that was spilled is *clean*: its key has a copy on disk too, so
evicting the CPU copy loses nothing.  Spills run ahead of need (``plan_spills``
keeps ``spill_below`` CPU rows free or clean), so a store never waits for one.

Recency is kept per request, deepest block first: the keys vLLM hands over in
one call (a store, a load, a touch) are a chain, block 0 first, and a chain
without its first block serves nothing.  So they are made recent in reverse:
eviction takes a chain's deepest blocks first, and what stays of it (on the
CPU or on disk) is always a prefix that serves.

Every row that starts or stops serving a key is told to the book once
(``RowBook.serve`` / ``unserve``), in the order it happened: the manager
writes the changes to the tiers' journals before anything it answers can
reuse the row, routers get them as residency events, and a restarted engine
``adopt``s what the journals say.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from ...rows.book import Fence, ResidencyEvent, RowBook, RowChange, TaskKind
from ...rows.ending import Settle
from ...rows.records import TierRecords
from ...wire.outcome import TaskOutcome
from ...wire.vocab import Op, Tier

Key = bytes
__all__ = ["CpuState", "Entry", "Found", "Key", "OffloadIndex", "RowChange"]


class Found(enum.Enum):
    """What a lookup finds."""

    MISS = "miss"
    HIT = "hit"  # readable from its CPU row now
    PENDING = "pending"  # being written (a store, a load from disk): ask again
    ON_DISK = "on_disk"  # only on disk: load it into a CPU row first (``start_load``)


class CpuState(enum.Enum):
    STORING = "storing"  # vLLM's store job writes the row
    LOADING = "loading"  # our load task writes it from the disk row
    READY = "ready"


@dataclass
class Entry:
    key: Key
    cpu_row: int | None = None
    cpu_state: CpuState | None = None
    disk_row: int | None = None
    spilling: bool = False  # our spill task writes disk_row from cpu_row
    readers: int = 0  # vLLM load jobs reading cpu_row
    doomed: bool = False  # a read of it failed: gone once its readers are done

    @property
    def clean(self) -> bool:
        """Its CPU copy can go without losing the key: a finished copy is on disk."""
        return self.disk_row is not None and not self.spilling


@dataclass
class OffloadIndex:
    cpu_rows: int
    disk_rows: int = 0
    spill_below: int = 0  # keep this many CPU rows free or clean (0: no spills)
    records: TierRecords | None = None  # whose KV the rows hold, and the tiers' journals
    entries: OrderedDict[Key, Entry] = field(default_factory=OrderedDict)  # least recently used first

    def __post_init__(self) -> None:
        for name in ("cpu_rows", "disk_rows", "spill_below"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        # The rows of both tiers and the tasks that write and read them (our spills and
        # loads; vLLM's jobs in flight at a fenced reset), from submit to settlement.
        self.book = RowBook({Tier.CPU: self.cpu_rows, Tier.DISK: self.disk_rows}, records=self.records)
        self._fences = 0  # fenced resets so far: each one's jobs are one task of the book

    def adopt(self, cpu: list[tuple[Key, int]], disk: list[tuple[Key, int]]) -> int:
        """Serve again what an earlier engine's journals say its rows hold
        (least recently used first): each key ready in its CPU row and/or
        clean on its disk row.  A row or key named twice, or out of range,
        is skipped (its first claim stands).  Returns the keys adopted."""
        for tier, pairs in ((Tier.CPU, cpu), (Tier.DISK, disk)):
            size = self.cpu_rows if tier is Tier.CPU else self.disk_rows
            for key, row in pairs:
                e = self.entries.get(key)
                if type(row) is not int or not 0 <= row < size or not self.book.pool(tier).num_free:
                    continue
                if self.book.pool(tier).is_allocated(row) or (e is not None and self._row_on(e, tier) is not None):
                    continue
                self.book.claim(tier, [row])
                if e is None:
                    e = self.entries[key] = Entry(key)
                if tier is Tier.CPU:
                    e.cpu_row, e.cpu_state = row, CpuState.READY
                else:
                    e.disk_row = row
                self.entries.move_to_end(key)
        for tier in (Tier.CPU, Tier.DISK):
            self.book.serve_all(tier, self.rows_of(tier))
        return len(self.entries)

    def keys_in(self, cpu_rows: list[int], writing: bool) -> list[Key]:
        """The keys whose CPU rows a vLLM job wrote (``writing``: a store) or read (a load)."""
        wanted = set(cpu_rows)
        state = CpuState.STORING if writing else CpuState.READY
        return [k for k, e in self.entries.items() if e.cpu_row in wanted and e.cpu_state is state]

    def rows_of(self, tier: Tier) -> list[tuple[Key, int]]:
        """(key, row) of every key ``tier`` serves now, least recently used first (what a journal names)."""
        pairs = ((k, self._row_on(e, tier)) for k, e in self.entries.items() if self._announced_on(e, tier))
        return [(k, row) for k, row in pairs if row is not None]

    def take_changes(self) -> list[RowChange]:
        return self.book.take_changes()

    def record(self) -> None:
        """Write the row changes so far to the tiers' journals (before anything answered
        or submitted can reuse a row)."""
        self.book.record(self.rows_of, len(self.entries))

    # --- what vLLM asks --------------------------------------------------------

    def lookup(self, key: Key) -> Found:
        e = self.entries.get(key)
        if e is None or e.doomed:
            return Found.MISS
        if e.cpu_state is CpuState.READY:
            return Found.HIT
        if e.cpu_state is not None:
            return Found.PENDING
        if e.disk_row is not None and not e.spilling:
            return Found.ON_DISK
        return Found.MISS

    def touch(self, keys: list[Key]) -> None:
        """The keys of one request were used: the first block becomes the most recent
        (a chain's deepest blocks are evicted first)."""
        for key in reversed(keys):
            if key in self.entries:
                self.entries.move_to_end(key)

    def prepare_load(self, keys: list[Key]) -> list[int]:
        """The CPU rows vLLM's load job reads; each key must be a hit."""
        rows = []
        for key in keys:
            e = self.entries[key]
            if e.cpu_state is not CpuState.READY or e.doomed or e.cpu_row is None:
                raise KeyError(f"key {key.hex()[:16]} is not readable from the CPU tier")
            e.readers += 1
            rows.append(e.cpu_row)
        self.touch(keys)
        return rows

    def complete_load(self, keys: list[Key], ok: bool) -> None:
        """A load job ended; a failed one dooms its keys (never a hit again)."""
        for key in keys:
            e = self.entries.get(key)
            if e is None or e.readers == 0:
                continue  # forgotten by a reset meanwhile
            e.readers -= 1
            if not ok:
                e.doomed = True
            if e.doomed and e.readers == 0:
                self._drop(e)

    def prepare_store(self, keys: list[Key]) -> tuple[list[Key], list[int], list[Key]] | None:
        """(keys to store, their CPU rows, keys evicted for them), or None when
        there is no room for all of them (nothing changes then)."""
        new = list(dict.fromkeys(k for k in keys if k not in self.entries))
        if len(new) > self._free(Tier.CPU) + self._evictable_cpu():
            return None
        evicted: list[Key] = []
        rows = [self._take_cpu_row(evicted) for _ in new]
        for key, row in reversed(list(zip(new, rows))):  # the chain's first block the most recent
            self.entries[key] = Entry(key, cpu_row=row, cpu_state=CpuState.STORING)
        return new, rows, evicted

    def complete_store(self, keys: list[Key], ok: bool) -> list[Key]:
        """A store job ended: its keys are readable (``ok``) or dropped.  Returns the keys stored."""
        stored = []
        for key in keys:
            e = self.entries.get(key)
            if e is None or e.cpu_state is not CpuState.STORING:
                continue
            if ok:
                e.cpu_state = CpuState.READY
                stored.append(e)
            else:
                self._drop(e, announce=False)
        self._said(Tier.CPU, stored, removed=False)
        return [e.key for e in stored]

    # --- what zkv does below ---------------------------------------------------

    def plan_spills(self, limit: int) -> list[tuple[Key, int, int]]:
        """Up to ``limit`` spills (key, CPU row, disk row) of the least recently
        used dirty rows, while fewer than ``spill_below`` CPU rows are free or clean."""
        if not self.disk_rows or not self.spill_below:
            return []
        spare = self._free(Tier.CPU) + sum(
            1 for e in self.entries.values() if e.cpu_state is CpuState.READY and (e.clean or e.spilling)
        )
        plan: list[tuple[Key, int, int]] = []
        for e in list(self.entries.values()):
            if spare >= self.spill_below or len(plan) >= limit:
                break
            if e.cpu_state is not CpuState.READY or e.doomed or e.disk_row is not None:
                continue
            row = self._take_disk_row(protect=e.key)
            if row is None:
                break
            e.disk_row, e.spilling = row, True
            plan.append((e.key, e.cpu_row, row))  # type: ignore[arg-type]
            spare += 1
        return plan

    def spills_sent(self, task: int, spills: list[tuple[Key, int, int]]) -> None:
        """These planned spills (key, CPU row, disk row) went as bus task ``task``."""
        self.book.begin(
            task,
            writes={Tier.DISK: [d for _, _, d in spills]},
            reads={Tier.CPU: [c for _, c, _ in spills]},
            payload=(Op.SPILL, spills),
        )

    def spills_not_sent(self, spills: list[tuple[Key, int, int]]) -> None:
        """The bus refused these planned spills: nothing wrote their disk rows."""
        for key, _, disk_row in spills:
            e = self.entries.get(key)
            if e is not None and e.spilling and e.disk_row == disk_row:
                e.spilling, e.disk_row = False, None
                self.book.give_back(Tier.DISK, [disk_row])

    def start_load(self, key: Key) -> tuple[int, int] | None:
        """(disk row, CPU row) of a load that brings an on-disk key back to the
        CPU tier, or None when no CPU row can be had now."""
        e = self.entries.get(key)
        if e is None or self.lookup(key) is not Found.ON_DISK:
            return None
        if not self._free(Tier.CPU) and not self._evictable_cpu():
            return None
        evicted: list[Key] = []
        row = self._take_cpu_row(evicted)
        e.cpu_row, e.cpu_state = row, CpuState.LOADING
        self.entries.move_to_end(key)
        return e.disk_row, row  # type: ignore[return-value]

    def loads_sent(self, task: int, loads: list[tuple[Key, int, int]]) -> None:
        """These started loads (key, disk row, CPU row) went as bus task ``task``."""
        self.book.begin(
            task,
            writes={Tier.CPU: [c for _, _, c in loads]},
            reads={Tier.DISK: [d for _, d, _ in loads]},
            payload=(Op.LOAD, loads),
        )

    def start_fetch(self, key: Key) -> int | None:
        """The CPU row a ``get`` from the shared store brings ``key`` into (the key is
        pending until the get ends), or None when it is known here or no row can be had."""
        if key in self.entries or (not self._free(Tier.CPU) and not self._evictable_cpu()):
            return None
        row = self._take_cpu_row([])
        self.entries[key] = Entry(key, cpu_row=row, cpu_state=CpuState.LOADING)
        return row

    def fetches_sent(self, task: int, fetches: list[tuple[Key, int]]) -> None:
        """These started fetches (key, CPU row) went as bus task ``task`` (a ``get``)."""
        self.book.begin(task, writes={Tier.CPU: [row for _, row in fetches]}, payload=(Op.GET, fetches))

    def cancel_fetch(self, key: Key, cpu_row: int) -> None:
        """A fetch that never started: the key is not here, the row is free."""
        e = self.entries.get(key)
        if e is not None and e.cpu_state is CpuState.LOADING and e.cpu_row == cpu_row and e.disk_row is None:
            e.cpu_state = None
            self._drop(e, announce=False)

    def puts_sent(self, task: int, puts: list[tuple[Key, int]]) -> None:
        """These ready keys' CPU rows are sent by bus task ``task`` (a ``put`` into the shared
        store): none of them is evicted or rewritten until its copies are over (a late put of
        a rewritten row would store another block's bytes under this key)."""
        self.book.begin(task, sends={Tier.CPU: [row for _, row in puts]}, payload=(Op.PUT, puts))

    def cancel_load(self, key: Key, cpu_row: int) -> None:
        """A load from disk that never started: the key stays on disk, the row is free."""
        e = self.entries.get(key)
        if e is not None and e.cpu_state is CpuState.LOADING and e.cpu_row == cpu_row:
            e.cpu_row, e.cpu_state = None, None
            self.book.give_back(Tier.CPU, [cpu_row])

    def task_ended(self, task: int, outcome: TaskOutcome) -> tuple[Op, int, list[Key]] | None:
        """One of our spills, loads, fetches (``get``) or puts ended: the book settles its rows
        by its one rule, and the keys still waiting on it learn what their rows are.  A spill
        that did not end ``ok`` leaves its key dirty on the CPU; a load or fetch that did not
        loses its key on every tier (a digest that did not check, a lost row, a value the
        store no longer has: never a hit); a put only read its rows.  Returns the op, how
        many keys it carried and the keys whose rows it filled (None: not a task of ours)."""
        flight = self.book.flight(task)
        if flight is None or flight.ended:
            return None
        op, items = flight.payload
        filled = self.book.end(task, outcome) is Settle.FILLED
        if op is Op.PUT:
            return op, len(items), []
        if op is Op.GET:
            items = [(key, None, row) for key, row in items]  # a load with no disk row
        done: list[Key] = []
        if op is Op.SPILL:
            for key, _, disk_row in items:
                e = self.entries.get(key)
                if e is None or not e.spilling or e.disk_row != disk_row:
                    continue  # forgotten meanwhile: the book frees its rows
                e.spilling = False
                if filled:
                    self._said(Tier.DISK, [e], removed=False)
                    done.append(key)
                else:
                    e.disk_row = None  # the book has the row
        else:
            for key, _, cpu_row in items:
                e = self.entries.get(key)
                if e is None or e.cpu_state is not CpuState.LOADING or e.cpu_row != cpu_row:
                    continue
                if filled:
                    e.cpu_state = CpuState.READY
                    self._said(Tier.CPU, [e], removed=False)
                    done.append(key)
                else:
                    e.cpu_row, e.cpu_state = None, None  # the book has the row
                    self._drop(e)
        return op, len(items), done

    def settle(self, tasks: list[int]) -> int:
        """These tasks' late copies are over (the bus says they settled): their held rows
        are free.  Returns how many tasks that was."""
        return len(self.book.settle(tasks))

    def reset(self, fenced: bool = False) -> list[Key]:
        """Forget every key (a generation moved).  Rows our own tasks still touch go
        once those tasks are over (the book's).  Rows vLLM's own jobs still write (a
        store) or read (a load) are free at once unless ``fenced`` (vLLM 0.34: its jobs
        in flight at a reset end later, and it says when, ``flushed``): then they are
        one ``Fence`` task of the book until then.  Returns the keys forgotten."""
        gone = list(self.entries)
        for tier in (Tier.CPU, Tier.DISK):
            self._said(tier, [e for e in self.entries.values() if self._announced_on(e, tier)], removed=True)
        if fenced:
            storing = [
                e.cpu_row for e in self.entries.values() if e.cpu_state is CpuState.STORING and e.cpu_row is not None
            ]
            reading = [e.cpu_row for e in self.entries.values() if e.readers and e.cpu_row is not None]
            if storing or reading:
                self._fences += 1
                self.book.begin(
                    Fence(self._fences),
                    writes={Tier.CPU: storing},
                    reads={Tier.CPU: reading},
                    kind=TaskKind.FENCE,
                )
        for e in list(self.entries.values()):
            self._drop(e, announce=False)
        return gone

    def flushed(self) -> None:
        """vLLM's jobs in flight at the fenced resets so far are over: their rows are free
        (those our own spills still read, once those spills end too)."""
        for fence in self.book.flights(TaskKind.FENCE):
            self.book.finish(fence.task, copied=False)

    # --- counts ------------------------------------------------------------------

    def used(self, tier: Tier) -> int:
        return self.book.pool(tier).num_used

    def take_events(self) -> list[ResidencyEvent]:
        return self.book.take_events()

    # --- rows --------------------------------------------------------------------

    def _cpu_evictable(self, e: Entry) -> bool:
        """A ready row nothing reads: not vLLM's loads, not a spill, not a put into the shared store."""
        return (
            e.cpu_state is CpuState.READY
            and e.readers == 0
            and not e.spilling
            and not self.book.touched(Tier.CPU, e.cpu_row)  # type: ignore[arg-type]
        )

    def _evictable_cpu(self) -> int:
        return sum(1 for e in self.entries.values() if self._cpu_evictable(e))

    def _free(self, tier: Tier) -> int:
        return self.book.pool(tier).num_free

    def _take_cpu_row(self, evicted: list[Key]) -> int:
        if self._free(Tier.CPU):
            return self.book.take(Tier.CPU, 1)[0]
        # A clean copy first (the key stays on disk), then the least recently used.
        victim = next((e for e in self.entries.values() if self._cpu_evictable(e) and e.clean), None)
        if victim is None:
            victim = next(e for e in self.entries.values() if self._cpu_evictable(e))
        row = victim.cpu_row
        assert row is not None
        self._said(Tier.CPU, [victim], removed=True)
        if victim.clean:
            victim.cpu_row, victim.cpu_state = None, None
        else:  # its only copy goes: the key with it (it was on no disk row)
            del self.entries[victim.key]
            evicted.append(victim.key)
        return row  # still in use: it passes from the victim to the caller

    def _take_disk_row(self, protect: Key) -> int | None:
        if self._free(Tier.DISK):
            return self.book.take(Tier.DISK, 1)[0]
        for e in self.entries.values():
            if e.key == protect or e.disk_row is None or e.spilling or e.cpu_state is CpuState.LOADING:
                continue
            row = e.disk_row
            self._said(Tier.DISK, [e], removed=True)
            if e.cpu_state is None:  # only on disk: the key goes
                del self.entries[e.key]
            else:  # its CPU copy stays, dirty again
                e.disk_row = None
            return row  # still in use: it passes from the key to the spill
        return None

    def _said(self, tier: Tier, entries: list[Entry], removed: bool) -> None:
        """Keys start or stop serving from their rows of ``tier``: one fact to the book
        (a row change for the journals, a residency event for routers)."""
        if not entries:
            return
        if removed:
            self.book.unserve(tier, [e.key for e in entries])
        else:
            self.book.serve_all(tier, [(e.key, self._row_on(e, tier)) for e in entries])  # type: ignore[misc]

    @staticmethod
    def _row_on(e: Entry, tier: Tier) -> int | None:
        return e.cpu_row if tier is Tier.CPU else e.disk_row

    @staticmethod
    def _announced_on(e: Entry, tier: Tier) -> bool:
        """A router was told the key is on ``tier`` (a stored event went out)."""
        if tier is Tier.CPU:
            return e.cpu_state is CpuState.READY
        return e.disk_row is not None and not e.spilling

    def _drop(self, e: Entry, announce: bool = True) -> None:
        """Forget ``e`` and give its rows back: free at once, or, while a task still
        touches them (a spill reads the CPU row and writes the disk row, a load from
        disk the other way round, vLLM's jobs under a fence), once it is over."""
        if announce:
            for tier in (Tier.CPU, Tier.DISK):
                if self._announced_on(e, tier):
                    self._said(tier, [e], removed=True)
        for tier, row in ((Tier.CPU, e.cpu_row), (Tier.DISK, e.disk_row)):
            if row is not None:
                self.book.give_back(tier, [row])
        del self.entries[e.key]
