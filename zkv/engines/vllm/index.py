"""What zkv holds for one vLLM engine, as its scheduler sees it: which offload
key lives in which CPU or disk row, in which state, in LRU order.

Sans-IO (docs/engine-vllm.md, "What holds"): the manager (``manager.py``)
turns vLLM's calls and zkv's task outcomes into calls here, and the answers
into tasks.  The rules it keeps, checked after every step by a model-based
test:

- a row belongs to at most one key per tier, or is free, or is held for a
  task of ours that may still touch it after its key was forgotten (the
  ``RowBook``'s holds, keyed by the task's (op, key, row)): nothing is handed
  out twice, and a row given back twice raises;
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

Every row that starts or stops serving a key is also a ``RowChange``
(``take_changes``), in the order it happened: the manager writes them to
the tiers' journals (``journal.py``) before anything it answers can reuse
the row, and a restarted engine ``adopt``s what they say.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from ...rows.book import ResidencyEvent, RowBook
from ...wire.vocab import Op, Tier

Key = bytes
FENCE = "fence"  # the book's holds for vLLM's jobs in flight at a fenced reset


class Found(enum.Enum):
    """What a lookup finds."""

    MISS = "miss"
    HIT = "hit"  # readable from its CPU row now
    PENDING = "pending"  # being written (a store, a load from disk): ask again
    ON_DISK = "on_disk"  # only on disk: load it into a CPU row first (``start_load``)


@dataclass(frozen=True)
class RowChange:
    """Row ``row`` of ``tier`` serves ``key`` from now on; ``row`` None: ``key`` left the tier."""

    tier: Tier
    key: Key
    row: int | None


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
    entries: OrderedDict[Key, Entry] = field(default_factory=OrderedDict)  # least recently used first

    def __post_init__(self) -> None:
        for name in ("cpu_rows", "disk_rows", "spill_below"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        # The rows of both tiers; those a task of ours still touches after its key
        # was forgotten (a reset, a failed read) are held under (op, key, row)
        # until the task ends.
        self.book = RowBook({Tier.CPU: self.cpu_rows, Tier.DISK: self.disk_rows})
        self.changes: list[RowChange] = []
        self._fences = 0  # holds made by fenced resets, numbered
        # A fenced row our own spill also reads: the fence's hold -> that spill, still out (at
        # vLLM's flush the hold passes to the spill; a spill that ends first leaves it to the flush).
        self._spill_of: dict[tuple, tuple] = {}

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
            self.book.announce(tier, [k for k, e in self.entries.items() if self._announced_on(e, tier)], removed=False)
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
        changes, self.changes = self.changes, []
        return changes

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

    def complete_store(self, keys: list[Key], ok: bool) -> None:
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

    def spill_done(self, key: Key, disk_row: int, ok: bool) -> None:
        if self._end_held(Op.SPILL, key, disk_row):
            return
        e = self.entries.get(key)
        if e is None or not e.spilling or e.disk_row != disk_row:
            return
        e.spilling = False
        if ok:
            self._said(Tier.DISK, [e], removed=False)
        else:
            e.disk_row = None
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

    def load_done(self, key: Key, cpu_row: int, ok: bool) -> None:
        """Our disk -> CPU load ended; a failed one (a digest that did not check,
        a lost row) loses the key on every tier."""
        if self._end_held(Op.LOAD, key, cpu_row):
            return
        e = self.entries.get(key)
        if e is None or e.cpu_state is not CpuState.LOADING or e.cpu_row != cpu_row:
            return
        if ok:
            e.cpu_state = CpuState.READY
            self._said(Tier.CPU, [e], removed=False)
        else:
            e.cpu_state = None  # the task is over: its rows are free with the key
            self._drop(e)

    def cancel_load(self, key: Key, cpu_row: int) -> None:
        """A load from disk that never started: the key stays on disk, the row is free."""
        if self._end_held(Op.LOAD, key, cpu_row):
            return
        e = self.entries.get(key)
        if e is not None and e.cpu_state is CpuState.LOADING and e.cpu_row == cpu_row:
            e.cpu_row, e.cpu_state = None, None
            self.book.give_back(Tier.CPU, [cpu_row])

    def reset(self, fenced: bool = False) -> list[Key]:
        """Forget every key (a generation moved).  Rows our own tasks still touch
        are held for those tasks to end.  Rows vLLM's own jobs still write (a
        store) or read (a load) are free at once unless ``fenced`` (vLLM 0.34:
        its jobs in flight at a reset end later, and it says when, ``flushed``):
        then they are held until then.  Returns the keys forgotten."""
        gone = list(self.entries)
        for tier in (Tier.CPU, Tier.DISK):
            self._said(tier, [e for e in self.entries.values() if self._announced_on(e, tier)], removed=True)
        for e in list(self.entries.values()):
            if fenced and e.cpu_row is not None and (e.cpu_state is CpuState.STORING or e.readers):
                self._fences += 1
                fence = (FENCE, self._fences)
                if e.spilling and e.disk_row is not None:  # our spill reads the row too, and writes its disk row
                    self.book.hold(fence, {Tier.CPU: [e.cpu_row], Tier.DISK: [e.disk_row]})
                    self._spill_of[fence] = (Op.SPILL, e.key, e.disk_row)
                    e.disk_row, e.spilling = None, False
                else:
                    self.book.hold(fence, {Tier.CPU: [e.cpu_row]})
                e.cpu_row, e.cpu_state, e.readers = None, None, 0
            self._drop(e, announce=False)
        return gone

    def flushed(self) -> None:
        """vLLM's jobs in flight at the last fenced reset are over: their rows are free (those
        our own spills still read, once those spills end too)."""
        tasks = (h.task for h in self.book.held_entries())
        for fence in [t for t in tasks if isinstance(t, tuple) and t[0] == FENCE]:
            spill = self._spill_of.pop(fence, None)
            if spill is None:
                self.book.settle([fence])
            else:
                self.book.pass_on(fence, spill)

    # --- counts ------------------------------------------------------------------

    def used(self, tier: Tier) -> int:
        return self.book.pool(tier).num_used

    def take_events(self) -> list[ResidencyEvent]:
        return self.book.take_events()

    # --- rows --------------------------------------------------------------------

    def _cpu_evictable(self, e: Entry) -> bool:
        return e.cpu_state is CpuState.READY and e.readers == 0 and not e.spilling

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
        """Keys start or stop serving from their rows of ``tier``: a residency
        event for routers, a row change for the journals."""
        if not entries:
            return
        self.book.announce(tier, [e.key for e in entries], removed=removed)
        for e in entries:
            self.changes.append(RowChange(tier, e.key, None if removed else self._row_on(e, tier)))

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
        """Forget ``e``; its rows are free at once unless a task of ours still
        touches them (a spill reads the CPU row and writes the disk row, a load
        from disk the other way round): then the book holds them for its end."""
        if announce:
            for tier in (Tier.CPU, Tier.DISK):
                if self._announced_on(e, tier):
                    self._said(tier, [e], removed=True)
        rows = {tier: [row] for tier, row in ((Tier.CPU, e.cpu_row), (Tier.DISK, e.disk_row)) if row is not None}
        if e.spilling:
            self.book.hold((Op.SPILL, e.key, e.disk_row), rows)
        elif e.cpu_state is CpuState.LOADING:
            self.book.hold((Op.LOAD, e.key, e.cpu_row), rows)
        else:
            for tier, ids in rows.items():
                self.book.give_back(tier, ids)
        del self.entries[e.key]

    def _end_held(self, op: str, key: Key, row: int) -> bool:
        """The task (op, key, row) ended after its key was forgotten: free what it held."""
        task = (op, key, row)
        fence = next((f for f, spill in self._spill_of.items() if spill == task), None)
        if fence is not None:  # the fence still holds its rows: vLLM's flush frees them
            del self._spill_of[fence]
            return True
        return bool(self.book.settle([task]))
