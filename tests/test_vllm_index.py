"""The vLLM offload index (zkv/engines/vllm/index.py), driven by a model of
what the bus really does to the rows: a store, a load from disk or a spill
writes its rows only when its task ends, or later (a timeout, a failure a
rank did not report: the copy lands after its outcome, at any later step), a
digest check fails a load from a disk row that was torn.  The tiers' journals take the index's row changes
after every call (as the manager writes them before it answers), and an
engine killed at any step restarts on what they say, on the same tiers or
under another identity.  After every step: no row is handed out twice,
every hit's CPU row holds exactly that key's bytes (after a restart too),
and rows a task is still reading or writing belong to nobody else.  The default run takes 100 examples
of 60 steps (about 7 s on 2 cores); ZKV_LONG_MODEL=1 runs the long profile (1000 examples of 100
steps, about a minute)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zkv.engines.vllm.index import CpuState, Found, OffloadIndex
from zkv.rows import EngineIdentity, RowChange, TaskKind
from zkv.rows.journal import Header, encode, encode_header, replay
from zkv.wire.outcome import TaskOutcome
from zkv.wire.vocab import Outcome, Tier

LONG = os.environ.get("ZKV_LONG_MODEL") == "1"
KEYS = [bytes([k]) * 4 for k in range(6)]
GARBAGE = b"garbage"
LATE = b"late"  # what a late copy leaves: neither a key's bytes nor a tear the digest catches

#: how one of our tasks ends: ok, a failure every rank reported, or late (its copy still to land)
ENDS = st.sampled_from(["ok", "ok", "ok", "failed", "timeout", "died"])


def outcome_of(task: int, end: str) -> TaskOutcome:
    if end == "ok":
        return TaskOutcome(task, Outcome.OK, "", every_rank_reported=True)
    if end == "failed":
        return TaskOutcome(task, Outcome.FAILED, "rank 1: disk_lost", every_rank_reported=True)
    return TaskOutcome(task, Outcome.TIMEOUT if end == "timeout" else Outcome.FAILED, f"{end}: a rank unheard")


keys = st.sampled_from(KEYS)
mostly_ok = st.sampled_from([True, True, True, False])  # tasks mostly succeed: deeper states
IDENTITY = EngineIdentity("llama", "", "cfg", {"block_size": 32, "layers": 2}, "files:w0")
SIZES = {Tier.CPU: 3, Tier.DISK: 4}


def journaled(method):
    """The rule, then the journals written: the manager appends the index's row
    changes at the end of every call it answers."""

    def step(self, *args, **kwargs):
        method(self, *args, **kwargs)
        self._write_journals()

    step.__name__, step.__doc__ = method.__name__, method.__doc__
    return step


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = OffloadIndex(cpu_rows=3, disk_rows=4, spill_below=2)
        self.rows = {Tier.CPU: [GARBAGE] * 3, Tier.DISK: [GARBAGE] * 4}  # what each row really holds
        self.stores: list[tuple[list[bytes], list[int]]] = []  # vLLM store jobs in flight
        self.loads: list[tuple[list[bytes], list[int]]] = []  # vLLM load jobs in flight
        self.spills: list[tuple[int, bytes, int, int]] = []  # (task, key, CPU row, disk row)
        self.promotes: list[tuple[int, bytes, int, int]] = []  # disk -> CPU loads in flight: (task, key, disk, CPU)
        self.late: list[tuple[int, Tier, int]] = []  # (task, tier, row) a copy may still write
        self.unsettled: set[int] = set()  # late copies landed, the bus not yet told settled
        self.fetches: list[tuple[int, bytes, int, bool]] = []  # gets from the shared store: (task, key, row, _)
        self.puts: list[tuple[int, bytes, int]] = []  # puts into it: (task, key, row)
        self.late_puts: list[tuple[int, bytes, int]] = []  # ended with their copies not over
        self.shared: dict[bytes, bytes] = {}  # what the shared store holds under each key
        self.next_task = 1
        self.fenced: list[tuple[list[bytes], list[int], bool]] = []  # vLLM jobs a fenced reset left in flight
        self.journals = {tier: self._journal(IDENTITY, tier) for tier in SIZES}
        self.adopted = 0

    @staticmethod
    def _journal(identity, tier, rows=()):
        changes = [RowChange(tier, k, r) for k, r in rows]
        return bytearray(encode_header(Header(identity, 0, tier, SIZES[tier])) + encode(changes))

    def _write_journals(self):
        """What the manager does before it answers vLLM or submits a task."""
        changes = self.index.take_changes()
        for tier, journal in self.journals.items():
            journal += encode([c for c in changes if c.tier is tier])

    # --- vLLM ---------------------------------------------------------------------

    @rule(ks=st.lists(keys, min_size=1, max_size=3))
    @journaled
    def store(self, ks):
        planned = self.index.prepare_store(ks)
        if planned is not None and planned[0]:
            new, rows, _ = planned
            self.stores.append((new, rows))

    @rule(ks=st.lists(keys, min_size=1, max_size=3))
    @journaled
    def store_and_spill_at_once(self, ks):
        """A busy engine: stores that succeed and the spills they trigger (reaches disk-only keys)."""
        self.store(ks)
        while self.stores:
            self.finish_store(0, True)
        self.spill()
        while self.spills:
            self.finish_spill(0, True)

    @precondition(lambda self: self.stores)
    @rule(i=st.integers(0, 10), ok=mostly_ok)
    @journaled
    def finish_store(self, i, ok):
        new, rows = self.stores.pop(i % len(self.stores))
        for key, row in zip(new, rows):
            self.rows[Tier.CPU][row] = key if ok else GARBAGE  # a failed copy leaves anything
        self.index.complete_store(new, ok)

    @rule(key=keys)
    @journaled
    def lookup_and_load(self, key):
        self.load(key)

    def load(self, key):
        found = self.index.lookup(key)
        if found is Found.HIT:
            rows = self.index.prepare_load([key])
            assert self.rows[Tier.CPU][rows[0]] == key
            self.loads.append(([key], rows))
        elif found is Found.ON_DISK:
            where = self.index.start_load(key)
            if where is not None:
                task = self._task()
                self.index.loads_sent(task, [(key, *where)])
                self.promotes.append((task, key, *where))

    def _task(self) -> int:
        self.next_task += 1
        return self.next_task

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 10), ok=mostly_ok)
    @journaled
    def finish_load(self, i, ok):
        ks, rows = self.loads.pop(i % len(self.loads))
        for key, row in zip(ks, rows):
            assert self.rows[Tier.CPU][row] == key, "a row was written while a load read it"
        self.index.complete_load(ks, ok)

    def _found(self, found):
        return sorted(k for k in self.index.entries if self.index.lookup(k) is found)

    @precondition(lambda self: self._found(Found.HIT))
    @rule(data=st.data())
    @journaled
    def load_a_hit(self, data):
        self.load(data.draw(st.sampled_from(self._found(Found.HIT))))

    @precondition(lambda self: self._found(Found.ON_DISK))
    @rule(data=st.data())
    @journaled
    def load_from_disk(self, data):
        self.load(data.draw(st.sampled_from(self._found(Found.ON_DISK))))

    @rule(ks=st.lists(keys, max_size=3))
    @journaled
    def touch(self, ks):
        self.index.touch(ks)

    # --- zkv below ------------------------------------------------------------------

    @rule()
    @journaled
    def spill(self):
        for key, cpu_row, disk_row in self.index.plan_spills(limit=3):
            task = self._task()
            self.index.spills_sent(task, [(key, cpu_row, disk_row)])
            self.spills.append((task, key, cpu_row, disk_row))

    @precondition(lambda self: self.spills)
    @rule(i=st.integers(0, 10), end=ENDS)
    @journaled
    def finish_spill(self, i, end):
        task, _key, cpu_row, disk_row = self.spills.pop(i % len(self.spills))
        if end == "ok":
            self.rows[Tier.DISK][disk_row] = self.rows[Tier.CPU][cpu_row]
        elif end == "failed":
            self.rows[Tier.DISK][disk_row] = GARBAGE
        else:
            self.late.append((task, Tier.DISK, disk_row))
        self.index.task_ended(task, outcome_of(task, end))

    @precondition(lambda self: self.promotes)
    @rule(i=st.integers(0, 10), end=ENDS)
    @journaled
    def finish_promote(self, i, end):
        task, key, disk_row, cpu_row = self.promotes.pop(i % len(self.promotes))
        ok = self.rows[Tier.DISK][disk_row] == key and end == "ok"  # the digest check, or any other failure
        if end in ("timeout", "died"):
            self.late.append((task, Tier.CPU, cpu_row))
        else:
            self.rows[Tier.CPU][cpu_row] = key if ok else GARBAGE
        self.index.task_ended(task, outcome_of(task, "ok" if ok else "failed" if end == "ok" else end))

    @precondition(lambda self: self.late)
    @rule(i=st.integers(0, 10), settle=st.booleans())
    @journaled
    def late_copy_lands(self, i, settle):
        """A slow rank copies at last; then the bus says the task settled (or not yet)."""
        task, tier, row = self.late.pop(i % len(self.late))
        self.rows[tier][row] = LATE
        if settle:
            self.index.settle([task])
        else:
            self.unsettled.add(task)

    @precondition(lambda self: self.unsettled)
    @rule()
    def settled(self):
        self.index.settle(sorted(self.unsettled))
        self.unsettled.clear()

    # --- the shared store below: fetches (get) and puts --------------------------------

    @rule(key=keys, another_engine_put_it=st.booleans())
    @journaled
    def fetch(self, key, another_engine_put_it):
        """A key this engine lacks: from the shared store, which another engine may have filled."""
        if another_engine_put_it:
            self.shared[key] = key
        row = self.index.start_fetch(key)
        if row is not None:
            task = self._task()
            self.index.fetches_sent(task, [(key, row)])
            self.fetches.append((task, key, row, True))

    @precondition(lambda self: self.fetches)
    @rule(i=st.integers(0, 10), end=ENDS)
    @journaled
    def finish_fetch(self, i, end):
        """The rank copies the value stored under the key (whatever bytes it holds: its digest is its own)."""
        task, key, row, _ = self.fetches.pop(i % len(self.fetches))
        value = self.shared.get(key)
        ok = value is not None and end == "ok"
        if end in ("timeout", "died"):
            self.late.append((task, Tier.CPU, row))
        else:
            self.rows[Tier.CPU][row] = value if ok else GARBAGE
        self.index.task_ended(task, outcome_of(task, "ok" if ok else "failed" if end == "ok" else end))

    @precondition(lambda self: self.index.rows_of(Tier.CPU))
    @rule(data=st.data())
    @journaled
    def put(self, data):
        key, row = data.draw(st.sampled_from(self.index.rows_of(Tier.CPU)))
        if any(p[2] == row for p in self.puts):
            return
        task = self._task()
        self.index.puts_sent(task, [(key, row)])
        self.puts.append((task, key, row))

    @precondition(lambda self: self.puts)
    @rule(i=st.integers(0, 10), end=ENDS)
    @journaled
    def finish_put(self, i, end):
        """The rank stores the row's bytes under the key: now (ok), never (failed), or later."""
        task, key, row = self.puts.pop(i % len(self.puts))
        if end == "ok":
            self.shared[key] = self.rows[Tier.CPU][row]
        elif end in ("timeout", "died"):
            self.late_puts.append((task, key, row))
        self.index.task_ended(task, outcome_of(task, end))

    @precondition(lambda self: self.late_puts)
    @rule(i=st.integers(0, 10), settle=st.booleans())
    def late_put_lands(self, i, settle):
        """A slow rank stores at last: what the row holds now."""
        task, key, row = self.late_puts.pop(i % len(self.late_puts))
        self.shared[key] = self.rows[Tier.CPU][row]
        if settle:
            self.index.settle([task])
        else:
            self.unsettled.add(task)

    @precondition(lambda self: self.promotes)
    @rule(i=st.integers(0, 10))
    @journaled
    def cancel_promote(self, i):
        task, key, _disk_row, cpu_row = self.promotes.pop(i % len(self.promotes))
        self.index.task_ended(task, TaskOutcome(task, Outcome.CANCELLED, "never dispatched", never_ran=True))

    @rule(row=st.integers(0, 3))
    @journaled
    def tear_disk_row(self, row):
        self.rows[Tier.DISK][row] = GARBAGE

    @rule(ok=st.booleans())
    @journaled
    def reset(self, ok):
        # vLLM's reset_cache flushes its jobs in flight (every worker waits for
        # them before the next step) and ignores their completions: their
        # copies end, the index never hears of them.  Our own tasks go on.
        for new, rows in self.stores:
            for key, row in zip(new, rows):
                self.rows[Tier.CPU][row] = key if ok else GARBAGE
        self.stores.clear()
        self.loads.clear()
        self.index.reset()
        self.index.take_changes()
        self.journals = {tier: self._journal(IDENTITY, tier) for tier in SIZES}  # removed, started anew

    @rule()
    def reset_fenced(self):
        """vLLM 0.34: its jobs in flight at a reset end after it (a store still writes
        its rows), and vLLM says when (``flushed``)."""
        self.fenced += [(new, rows, True) for new, rows in self.stores]
        self.fenced += [(ks, rows, False) for ks, rows in self.loads]
        self.stores, self.loads = [], []
        self.index.reset(fenced=True)
        self.index.take_changes()
        self.journals = {tier: self._journal(IDENTITY, tier) for tier in SIZES}

    @precondition(lambda self: self.fenced)
    @rule(ok=st.booleans())
    def flushed(self, ok):
        for ks, rows, store in self.fenced:
            if store:  # the late write lands, whole or not
                for key, row in zip(ks, rows):
                    self.rows[Tier.CPU][row] = key if ok else GARBAGE
        self.fenced = []
        self.index.flushed()

    @rule(
        ends=st.lists(st.booleans(), min_size=12, max_size=12),
        cpu_survives=st.booleans(),
        same_identity=st.sampled_from([True, True, True, False]),
    )
    def kill_and_restart(self, ends, cpu_survives, same_identity):
        """kill -9 at this step: every write in flight ends whole or torn, nobody hears of
        it; the host may lose its memory (the CPU tier and its journal with it).  The new
        engine adopts what the journals say under its identity."""
        writes = [(Tier.CPU, r, k) for ks, rows in self.stores for k, r in zip(ks, rows)]
        writes += [(Tier.CPU, c, k) for _, k, _, c in self.promotes]
        writes += [(Tier.DISK, d, self.rows[Tier.CPU][c]) for _, _, c, d in self.spills]
        writes += [(tier, row, LATE) for _, tier, row in self.late]
        writes += [(Tier.CPU, row, key) for _, key, row, _ in self.fetches]
        for (tier, row, value), whole in zip(writes, ends + [False] * len(writes)):
            self.rows[tier][row] = value if whole else GARBAGE
        if not cpu_survives:
            self.rows[Tier.CPU] = [GARBAGE] * SIZES[Tier.CPU]
            self.journals[Tier.CPU] = self._journal(IDENTITY, Tier.CPU)
        self.stores, self.loads, self.spills, self.promotes, self.fenced, self.late = [], [], [], [], [], []
        self.fetches, self.puts, self.late_puts = [], [], []
        self.unsettled = set()
        identity = IDENTITY if same_identity else IDENTITY.moved()
        found = {tier: replay(bytes(j)) for tier, j in self.journals.items()}
        self.index = OffloadIndex(cpu_rows=3, disk_rows=4, spill_below=2)
        if all(f.header.identity == identity for f in found.values()):
            cpu, disk = (list(found[t].rows.items()) for t in (Tier.CPU, Tier.DISK))
            self.adopted += self.index.adopt(cpu, disk)
        else:
            assert not self.index.entries
        self.index.take_changes()
        self.journals = {t: self._journal(identity, t, self.index.rows_of(t)) for t in SIZES}

    # --- what must hold -----------------------------------------------------------

    @invariant()
    def every_row_has_one_owner(self):
        for tier, n in ((Tier.CPU, 3), (Tier.DISK, 4)):
            owned = [e.cpu_row if tier is Tier.CPU else e.disk_row for e in self.index.entries.values()]
            owned = [r for r in owned if r is not None]
            held = self.index.book.let_go(tier)
            free = self.index.book.free_rows(tier)
            every = owned + held + free
            assert sorted(every) == list(range(n)), (tier, owned, held, free)
        self.index.book.check()

    @invariant()
    def the_journals_name_exactly_what_the_index_serves(self):
        for tier, journal in self.journals.items():
            assert dict(replay(bytes(journal)).rows) == dict(self.index.rows_of(tier)), tier

    @invariant()
    def held_rows_belong_only_to_tasks_that_may_still_touch_them(self):
        ours = {t for t, *_ in self.spills} | {t for t, *_ in self.promotes}
        ours |= {t for t, *_ in self.fetches} | {t for t, *_ in self.puts} | {t for t, *_ in self.late_puts}
        ours |= {t for t, _, _ in self.late} | self.unsettled
        flights = self.index.book.flights()
        fences = [f for f in flights if f.kind is TaskKind.FENCE]
        assert {f.task for f in flights if f.kind is TaskKind.BUS} <= ours, "rows no task will ever give back"
        assert not fences or self.fenced, "rows a fence holds after vLLM said its jobs are over"

    @invariant()
    def rows_a_late_copy_may_write_belong_to_nobody(self):
        for _task, tier, row in self.late:
            owners = [
                k for k, e in self.index.entries.items() if (e.cpu_row if tier is Tier.CPU else e.disk_row) == row
            ]
            assert not owners and row not in self.index.book.free_rows(tier), (tier, row, owners)

    @invariant()
    def rows_vllm_still_writes_after_a_reset_belong_to_nobody(self):
        for _ks, rows, store in self.fenced:
            for row in rows:
                owners = [k for k, e in self.index.entries.items() if e.cpu_row == row]
                assert not owners and row not in self.index.book.free_rows(Tier.CPU), (row, owners, store)

    @invariant()
    def the_shared_store_never_holds_another_keys_bytes_under_a_name(self):
        for key, value in self.shared.items():
            assert value in (key, GARBAGE, LATE), f"{value!r} stored under {key!r}"
        for _task, key, row in self.late_puts:
            holders = [k for k, e in self.index.entries.items() if e.cpu_row == row]
            assert holders in ([], [key]), f"CPU row {row} a late put may still send for {key!r} went to {holders}"

    @invariant()
    def a_hit_is_exactly_its_key(self):
        for key, e in self.index.entries.items():
            if self.index.lookup(key) is Found.HIT:
                assert self.rows[Tier.CPU][e.cpu_row] == key

    @invariant()
    def a_clean_copy_is_its_key_unless_torn(self):
        for key, e in self.index.entries.items():
            if e.disk_row is not None and not e.spilling and self.rows[Tier.DISK][e.disk_row] not in (key, GARBAGE):
                raise AssertionError(f"disk row {e.disk_row} holds another key's bytes for {key!r}")

    @invariant()
    def rows_in_use_by_tasks_belong_to_them(self):
        for new, rows in self.stores:
            for key, row in zip(new, rows):
                e = self.index.entries.get(key)
                writers = [k for k, ee in self.index.entries.items() if ee.cpu_row == row]
                assert row not in self.index.book.free_rows(Tier.CPU) or e is None
                assert writers in ([], [key]), f"CPU row {row} being stored for {key!r} is also {writers}"
        for _task, _key, disk_row, cpu_row in self.promotes:
            assert cpu_row not in self.index.book.free_rows(Tier.CPU)
            assert disk_row not in self.index.book.free_rows(Tier.DISK)
        for _task, key, cpu_row, disk_row in self.spills:
            assert disk_row not in self.index.book.free_rows(Tier.DISK)
            reading = f"a spill of {key!r} still reads CPU row {cpu_row}"
            assert cpu_row not in self.index.book.free_rows(Tier.CPU), reading
        for _ks, rows in self.loads:
            for row in rows:
                assert row not in self.index.book.free_rows(Tier.CPU)
        for _task, key, row, _ in self.fetches:
            writers = [k for k, e in self.index.entries.items() if e.cpu_row == row]
            assert row not in self.index.book.free_rows(Tier.CPU) and writers in ([], [key]), (row, writers)
        for _task, key, row in self.puts:
            readers = [k for k, e in self.index.entries.items() if e.cpu_row == row]
            assert row not in self.index.book.free_rows(Tier.CPU), f"a put still reads CPU row {row}"
            assert readers in ([], [key]), f"CPU row {row} a put reads for {key!r} was given to {readers}"

    @invariant()
    def pending_entries_are_not_hits(self):
        for key, e in self.index.entries.items():
            if e.cpu_state in (CpuState.STORING, CpuState.LOADING):
                assert self.index.lookup(key) is Found.PENDING


IndexMachine.TestCase.settings = settings(
    max_examples=1000 if LONG else 100, stateful_step_count=100 if LONG else 60, deadline=None
)
test_index_model = pytest.mark.timeout(1800 if LONG else 120)(IndexMachine.TestCase)


def test_a_failed_load_is_never_a_hit_again():
    index = OffloadIndex(cpu_rows=2)
    new, rows, _ = index.prepare_store([b"a"])
    index.complete_store(new, ok=True)
    assert index.lookup(b"a") is Found.HIT
    index.prepare_load([b"a"])
    index.complete_load([b"a"], ok=False)
    assert index.lookup(b"a") is Found.MISS
    assert sorted(index.book.free_rows(Tier.CPU)) == [0, 1]


def test_a_full_tier_refuses_a_store_without_changing_anything():
    index = OffloadIndex(cpu_rows=1)
    new, _, _ = index.prepare_store([b"a"])
    assert index.prepare_store([b"b"]) is None  # a is still being stored: nothing to evict
    index.complete_store(new, ok=True)
    new, _, evicted = index.prepare_store([b"b"])
    assert (new, evicted) == ([b"b"], [b"a"])


def _chain(name: str, n: int) -> list[bytes]:
    return [f"{name}{i:03d}".encode() for i in range(n)]


def _store(index: OffloadIndex, chain: list[bytes]) -> None:
    """One request's store, ended ok, then the spills it triggers, ended ok."""
    planned = index.prepare_store(chain)
    assert planned is not None
    index.complete_store(planned[0], ok=True)
    spills = index.plan_spills(64)
    if spills:
        task = max((f.task for f in index.book.flights()), default=0) + 1
        index.spills_sent(task, spills)
        index.task_ended(task, TaskOutcome(task, Outcome.OK, "", every_rank_reported=True))


def test_a_chain_that_left_the_cpu_comes_back_from_disk_head_first():
    """Five 21-block requests through 40 CPU rows: the first one's whole chain is on
    disk when it returns (every row spilled before a store needs it), and a lookup
    walks it head first."""
    index = OffloadIndex(cpu_rows=40, disk_rows=512, spill_below=40)
    chains = [_chain(name, 21) for name in "ABCDE"]
    for chain in chains:
        _store(index, chain)
    assert [index.lookup(key) for key in chains[0]] == [Found.ON_DISK] * 21
    assert index.lookup(chains[-1][0]) is Found.HIT


def test_spilling_fewer_rows_than_a_store_needs_loses_the_chains_head():
    """Why the default spills every row: with 5 kept clean, a 21-block store drops
    rows whose only copy was on the CPU, and the first request is gone."""
    index = OffloadIndex(cpu_rows=40, disk_rows=512, spill_below=5)
    chains = [_chain(name, 21) for name in "ABCDE"]
    for chain in chains:
        _store(index, chain)
    found = [index.lookup(key) for key in chains[0]]
    assert Found.MISS in found


def test_eviction_takes_a_chains_deepest_blocks_first():
    """No disk: of a chain pushed out of the CPU tier, what stays is its head (a
    prefix still serves), and a touch keeps the head the most recent."""
    index = OffloadIndex(cpu_rows=30)
    first, second = _chain("A", 20), _chain("B", 20)
    _store(index, first)
    _store(index, second)
    kept = [index.lookup(key) is Found.HIT for key in first]
    assert kept == [True] * 10 + [False] * 10, kept
    index.touch(first[:10])
    _store(index, _chain("C", 10))  # evicts from B's tail, not A's head
    assert all(index.lookup(key) is Found.HIT for key in first[:10])
    assert [index.lookup(key) is Found.HIT for key in second] == [True] * 10 + [False] * 10


def test_a_fenced_row_our_spill_still_reads_stays_held_until_the_spill_ends_too():
    """vLLM 0.34: a reset while vLLM loads a row and our spill reads it; vLLM says its jobs
    are flushed before the spill ends: the row is still the spill's until it ends."""
    index = OffloadIndex(cpu_rows=3, disk_rows=4, spill_below=3)
    index.prepare_store([b"k"])
    index.complete_store([b"k"], ok=True)
    spills = index.plan_spills(4)
    ((key, cpu_row, disk_row),) = spills
    index.spills_sent(9, spills)
    assert index.lookup(b"k") is Found.HIT and index.prepare_load([b"k"]) == [cpu_row]  # vLLM reads it
    index.reset(fenced=True)
    index.flushed()  # vLLM's load is over; our spill is not
    assert cpu_row not in index.book.free_rows(Tier.CPU) and disk_row not in index.book.free_rows(Tier.DISK)
    index.task_ended(9, TaskOutcome(9, Outcome.OK, "", every_rank_reported=True))
    assert cpu_row in index.book.free_rows(Tier.CPU) and disk_row in index.book.free_rows(Tier.DISK)


def test_a_late_put_keeps_its_row_from_another_key_until_it_settles():
    """A put's rows are *sent* beyond the book (held until it settles), not only read: a put that
    timed out may still store the row, and a row rewritten meanwhile would be another key's bytes
    under its key, served to another engine."""
    index = OffloadIndex(cpu_rows=1)
    new, rows, _ = index.prepare_store([b"a"])
    index.complete_store(new, ok=True)
    index.puts_sent(7, [(b"a", rows[0])])
    index.task_ended(7, TaskOutcome(7, Outcome.TIMEOUT, "the store is slow"))
    assert index.prepare_store([b"b"]) is None, "the only row went to another key while a late put may send it"
    assert index.lookup(b"a") is Found.HIT, "the key itself is still served"
    index.settle([7])
    planned = index.prepare_store([b"b"])
    assert planned is not None and planned[1] == rows and planned[2] == [b"a"]
