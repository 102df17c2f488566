"""The book of tier rows (zkv/rows/book.py), driven by a model of its owners and of the ranks.

A hypothesis state machine plays an engine path over a ``RowBook`` of a GPU,
a CPU and a disk tier: it takes rows, runs tasks that write them (and read
filled ones), and ends each task the ways a bus ends one: ``ok``; a failure
every rank reported; a failure no rank reported (a rank died while another
still copied); a timeout; a generation move heard before the last result;
never dispatched (cancelled, rejected).  The owner acts only on what the book
answers (``end``); the *ranks* act on what really happened: a task whose
copies were not over may write its rows at any later step (a late copy, also
after its tier was renewed: a rank that kept its memory still copies), until
the bus reports it settled or drains.  It also serves, evicts, clears with and
without keeping the CPU tier, moves generations, restarts, and misuses the
book.  After every step it checks:

- no row handed out twice: the owner's rows, the rows let go and the free
  rows are every row of the tier, each once;
- no double free: a give-back of a free or let-go row raises and changes nothing;
- every row a late copy may still write is out of reach (let go), and no row
  served that its holder did not write, whatever late copy landed;
- no leak: once every task is over and every key evicted, every row is free.

Two mutations of the book must be caught by it (the last tests): freeing the
rows of a failure no rank reported, and a renewal that forgets the rows a late
copy may still write.

``ZKV_BOOK_EXAMPLES`` sets how many histories run (default 150; the long
profile in docs/architecture.md uses 3000).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import zkv.rows.book as book_module
from zkv.rows import (
    DoubleFreeError,
    Fence,
    ForeignBlockError,
    HeldRowError,
    OutOfBlocksError,
    RowBook,
    Settle,
    TaskKind,
    settle_of,
)
from zkv.wire.outcome import TaskOutcome
from zkv.wire.vocab import Outcome, Tier

SIZES = {Tier.GPU: 5, Tier.CPU: 6, Tier.DISK: 4}
RESERVED = {Tier.GPU: (0,)}  # an engine's own row (vLLM's null block): never handed out
TIERS = tuple(SIZES)
EXAMPLES = int(os.environ.get("ZKV_BOOK_EXAMPLES", "150"))

#: how a task ends: (outcome, never ran, every rank reported); ok and the late ends twice
ENDS = {
    "ok": (Outcome.OK, False, True),
    "failed, every rank reported": (Outcome.FAILED, False, True),
    "failed, a rank died": (Outcome.FAILED, False, False),
    "timeout": (Outcome.TIMEOUT, False, False),
    "timeout, never dispatched": (Outcome.TIMEOUT, True, False),
    "cancelled, never dispatched": (Outcome.CANCELLED, True, False),
    "cancelled by a generation move": (Outcome.CANCELLED, False, False),
    "rejected": (Outcome.REJECTED, True, False),
}
END_NAMES = [*ENDS, "ok", "failed, a rank died", "timeout"]


@dataclass
class Task:
    writes: dict[Tier, list[int]]
    reads: dict[Tier, list[int]] = field(default_factory=dict)
    lost: set[Tier] = field(default_factory=set)  # tiers renewed under it: those rows are not the owner's


class BookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._fresh()
        self.next_task = 1

    # --- the model ---------------------------------------------------------------

    def _fresh(self) -> None:
        self.book = RowBook(SIZES, RESERVED)
        self.memory: dict[Tier, dict[int, int | None]] = {t: dict.fromkeys(range(n)) for t, n in SIZES.items()}
        self.empty: dict[Tier, set[int]] = {t: set() for t in TIERS}  # taken, nothing written yet
        self.filled: dict[Tier, dict[int, int]] = {t: {} for t in TIERS}  # row -> the task that wrote it
        self.running: dict[int, Task] = {}  # in flight: the book touches its rows
        self.late: dict[int, dict[Tier, list[int]]] = {}  # ended with its copies not over: may still write

    def owners_rows(self, tier: Tier) -> list[int]:
        rows = [*self.empty[tier], *self.filled[tier]]
        rows += [r for task in self.running.values() if tier not in task.lost for r in task.writes.get(tier, ())]
        return rows

    def has_something_to_lose(self) -> bool:
        return bool(self.late or self.running) or any(self.filled.values())

    @precondition(has_something_to_lose)
    @rule()
    def restart(self) -> None:
        """The owner's process restarts: a new book on fresh memory (the old copies land in the old)."""
        self._fresh()

    # --- rows and tasks ----------------------------------------------------------

    @rule(tier=st.sampled_from(TIERS), count=st.integers(0, 4))
    def take(self, tier: Tier, count: int) -> None:
        free_before = self.book.pool(tier).num_free
        if count > free_before:
            with pytest.raises(OutOfBlocksError):
                self.book.take(tier, count)
            assert self.book.pool(tier).num_free == free_before, "a refused take changed the pool"
            return
        rows = self.book.take(tier, count)
        assert len(set(rows)) == count
        owned = set(self.owners_rows(tier)) | set(self.book.let_go(tier))
        assert owned.isdisjoint(rows), f"{tier}: rows {sorted(owned & set(rows))} handed out twice"
        assert not set(rows) & set(RESERVED.get(tier, ())), "a reserved row handed out"
        self.empty[tier].update(rows)

    @rule(tier=st.sampled_from(TIERS), count=st.integers(1, 3))
    def take_for_a_task(self, tier: Tier, count: int) -> None:
        """Take rows and start a task writing them at once (a store, a swap)."""
        if count > self.book.pool(tier).num_free:
            return
        self.take(tier, count)
        rows = self.book.pool(tier).allocated_ids()
        fresh = sorted(set(self.empty[tier]) & set(rows))[-count:]
        self._start(tier, fresh, {})

    @precondition(lambda self: any(self.empty.values()))
    @rule(data=st.data())
    def start_task(self, data: st.DataObject) -> None:
        """A task begins writing some empty rows, and perhaps reading filled rows of another tier."""
        tier = data.draw(st.sampled_from([t for t in TIERS if self.empty[t]]))
        rows = data.draw(st.lists(st.sampled_from(sorted(self.empty[tier])), min_size=1, unique=True))
        reads: dict[Tier, list[int]] = {}
        sources = [t for t in TIERS if t != tier and self.filled[t]]
        if sources and data.draw(st.booleans()):
            src = data.draw(st.sampled_from(sources))
            reads[src] = data.draw(st.lists(st.sampled_from(sorted(self.filled[src])), min_size=1, unique=True))
        self._start(tier, rows, reads)

    def _start(self, tier: Tier, rows: list[int], reads: dict[Tier, list[int]]) -> None:
        task = self.next_task
        self.next_task += 1
        self.book.begin(task, writes={tier: rows}, reads=reads)
        self.empty[tier].difference_update(rows)
        self.running[task] = Task({tier: rows}, reads)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), end=st.sampled_from(END_NAMES))
    def end_task(self, data: st.DataObject, end: str) -> None:
        task = data.draw(st.sampled_from(sorted(self.running)))
        outcome, never_ran, reported = ENDS[end]
        t = self.running.pop(task)
        if outcome == Outcome.OK:
            for tier, rows in t.writes.items():
                for row in rows:
                    self.memory[tier][row] = task  # every rank's copy landed before the outcome
        over = never_ran or reported
        if not over:
            self.late[task] = t.writes  # the ranks may still copy, whatever the book says
        said = self.book.end(task, TaskOutcome(task, outcome, end, never_ran=never_ran, every_rank_reported=reported))
        for tier, rows in t.writes.items():
            if tier in t.lost:
                continue  # renewed under it: not the owner's any more
            if said is Settle.FILLED:
                self.filled[tier].update(dict.fromkeys(rows, task))
            # FREED / HELD: the owner forgets them

    @precondition(lambda self: self.late)
    @rule(data=st.data(), settle=st.booleans())
    def late_write(self, data: st.DataObject, settle: bool) -> None:
        """A slow rank copies at last, then the bus says the task settled (or not yet)."""
        task = data.draw(st.sampled_from(sorted(self.late)))
        for tier, rows in self.late[task].items():
            for row in rows:
                self.memory[tier][row] = task
        if settle:
            del self.late[task]
            self.book.settle([task])

    @precondition(lambda self: any(self.filled.values()))
    @rule(data=st.data())
    def serve(self, data: st.DataObject) -> None:
        """Read a filled row: its memory holds exactly what its holder wrote."""
        tier = data.draw(st.sampled_from([t for t in TIERS if self.filled[t]]))
        row = data.draw(st.sampled_from(sorted(self.filled[tier])))
        assert self.memory[tier][row] == self.filled[tier][row], f"{tier} row {row}: a late copy wrote a reused row"

    @precondition(lambda self: any(self.filled.values()) or any(self.empty.values()))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """Give rows back (a row a running task still reads goes once the task is over)."""
        tier = data.draw(st.sampled_from([t for t in TIERS if self.filled[t] or self.empty[t]]))
        rows = data.draw(st.lists(st.sampled_from(sorted(set(self.filled[tier]) | self.empty[tier])), unique=True))
        assert self.book.give_back(tier, rows)
        for row in rows:
            self.filled[tier].pop(row, None)
            self.empty[tier].discard(row)

    # --- misuse ------------------------------------------------------------------

    @rule(tier=st.sampled_from(TIERS), data=st.data())
    def double_free_is_refused(self, tier: Tier, data: st.DataObject) -> None:
        not_mine = sorted(set(self.book.free_rows(tier)) | set(self.book.let_go(tier)))
        not_mine += RESERVED.get(tier, [])
        if not not_mine:
            return
        row = data.draw(st.sampled_from(not_mine))
        before = (self.book.free_rows(tier), self.book.held())
        with pytest.raises((DoubleFreeError, ForeignBlockError, HeldRowError)):
            self.book.give_back(tier, [row])
        assert (self.book.free_rows(tier), self.book.held()) == before, "a refused give-back changed the book"

    @precondition(lambda self: any(self.book.let_go(t) for t in TIERS))
    @rule(data=st.data())
    def a_let_go_row_cannot_start_a_task(self, data: st.DataObject) -> None:
        tier = data.draw(st.sampled_from([t for t in TIERS if self.book.let_go(t)]))
        row = data.draw(st.sampled_from(self.book.let_go(tier)))
        with pytest.raises(HeldRowError):
            self.book.begin("intruder", writes={tier: [row]})
        assert not self.book.flights() or all(f.task != "intruder" for f in self.book.flights())

    @precondition(lambda self: any(self.filled.values()))
    @rule(data=st.data())
    def give_back_under_an_old_generation_changes_nothing(self, data: st.DataObject) -> None:
        tier = data.draw(st.sampled_from([t for t in TIERS if self.filled[t]]))
        before = self.book.free_rows(tier)
        assert self.book.give_back(tier, sorted(self.filled[tier]), self.book.generation(tier) - 1) is False
        assert self.book.free_rows(tier) == before

    # --- drains, clears and generation moves -------------------------------------

    def _land_every_late_copy(self) -> None:
        for rows in self.late.values():
            for tier, ids in rows.items():
                for row in ids:
                    self.memory[tier][row] = -1  # whatever it wrote: never served again
        self.late.clear()

    @precondition(lambda self: self.late and not self.running)
    @rule()
    def drain(self) -> None:
        """Every rank acked a pause: every late copy is over."""
        self._land_every_late_copy()
        self.book.drain()
        assert not self.book.held_entries()

    @precondition(lambda self: has_something_to_lose(self) and not self.running)
    @rule(keep_cpu=st.booleans())
    def clear(self, keep_cpu: bool) -> None:
        """The bus drained, then cleared: the GPU rows go (and the CPU and disk rows unless kept)."""
        self.drain() if self.late else None
        for tier in TIERS:
            if tier is Tier.GPU or not keep_cpu:
                self._renew(tier)
        assert self.book.held() == dict.fromkeys(TIERS, 0), "a drained book holds rows"

    @precondition(has_something_to_lose)
    @rule(tiers=st.sampled_from([(Tier.GPU,), TIERS]))
    def move(self, tiers: tuple[Tier, ...]) -> None:
        """The bus's generations moved without our clear (a rank restarted on fresh
        memory; the others kept theirs and may still be copying)."""
        for tier in tiers:
            self._renew(tier)

    def _renew(self, tier: Tier) -> None:
        self.book.renew(tier, SIZES[tier], RESERVED.get(tier, ()))
        self.empty[tier].clear()
        self.filled[tier].clear()
        for task in self.running.values():
            if tier in task.writes:
                task.lost.add(tier)
            task.reads.pop(tier, None)

    # --- what must hold ----------------------------------------------------------

    @invariant()
    def every_row_once(self) -> None:
        self.book.check()
        for tier, n in SIZES.items():
            every = [*self.owners_rows(tier), *self.book.let_go(tier), *self.book.free_rows(tier)]
            every += RESERVED.get(tier, ())
            assert sorted(every) == list(range(n)), f"{tier}: {sorted(every)}"

    @invariant()
    def rows_a_late_copy_may_write_are_out_of_reach(self) -> None:
        """The cause, checked at once (the late copy itself may land much later)."""
        for task, rows in self.late.items():
            for tier, ids in rows.items():
                let_go = set(self.book.let_go(tier))
                assert let_go.issuperset(ids), f"{tier}: task {task} may still write rows {ids}, not held"

    @invariant()
    def filled_rows_hold_what_their_holder_wrote(self) -> None:
        for tier in TIERS:
            for row, writer in self.filled[tier].items():
                assert self.memory[tier][row] == writer, f"{tier} row {row}: a late copy wrote a reused row"

    def teardown(self) -> None:
        """No leak: every task over, every key evicted, and every row is free."""
        for task in list(self.running):
            self.book.end(task, TaskOutcome(task, Outcome.CANCELLED, "", never_ran=True))
            self.running.pop(task)
        self._land_every_late_copy()
        self.book.drain()
        for tier in TIERS:
            self.book.give_back(tier, [*self.empty[tier], *self.filled[tier]])
            assert self.book.pool(tier).num_free == SIZES[tier] - len(RESERVED.get(tier, ())), f"{tier} leaked"


def has_something_to_lose(self: BookMachine) -> bool:
    return self.has_something_to_lose()


SETTINGS = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRowBook = BookMachine.TestCase
TestRowBook.settings = SETTINGS


# --- the model catches the mutations it is for ---------------------------------------

#: a mutant's first failure is enough: no shrinking
MUTANT = settings(SETTINGS, max_examples=200, database=None, derandomize=True, phases=[Phase.generate])


def test_the_model_catches_a_book_that_frees_the_rows_of_a_failure_no_rank_reported(monkeypatch):
    def frees_unreported_failures(outcome: TaskOutcome) -> Settle:
        if outcome.outcome == Outcome.FAILED:
            return Settle.FREED
        return settle_of(outcome)

    monkeypatch.setattr(book_module, "settle_of", frees_unreported_failures)
    with pytest.raises(AssertionError, match="may still write rows"):
        run_state_machine_as_test(BookMachine, settings=MUTANT)


def test_the_model_catches_a_renewal_that_forgets_what_a_late_copy_may_write(monkeypatch):
    monkeypatch.setattr(RowBook, "_keep_touched", forgets_touched_rows)
    with pytest.raises(AssertionError, match="may still write rows"):
        run_state_machine_as_test(BookMachine, settings=MUTANT)


def forgets_touched_rows(self: RowBook, tier: Tier, touches) -> None:
    """The old renewal: rows tasks touched went with the old generation."""
    for flight in list(self._flights.values()):
        for part in (flight.writes, flight.reads):
            part.pop(tier, None)
        if flight.ended and not any(flight.writes.values()):
            del self._flights[flight.task]


# --- examples ------------------------------------------------------------------------


def test_a_task_named_twice_or_a_row_not_held_is_refused_before_anything_changes():
    book = RowBook({Tier.CPU: 3})
    rows = book.take(Tier.CPU, 2)
    book.begin(7, writes={Tier.CPU: rows[:1]})
    with pytest.raises(HeldRowError):
        book.begin(7, writes={Tier.CPU: rows[1:]})
    with pytest.raises(HeldRowError):
        book.begin(8, writes={Tier.CPU: [2]})  # never taken
    with pytest.raises(HeldRowError):
        book.begin(9, writes={Tier.CPU: [rows[1], rows[1]]})  # named twice
    assert [f.task for f in book.flights()] == [7]
    book.check()


def test_the_rows_a_task_writes_follow_its_outcome():
    book = RowBook({Tier.CPU: 4})
    a, b, c = book.take(Tier.CPU, 1), book.take(Tier.CPU, 1), book.take(Tier.CPU, 1)
    for task, rows in ((1, a), (2, b), (3, c)):
        book.begin(task, writes={Tier.CPU: rows})
    assert book.end(1, TaskOutcome(1, Outcome.OK, "", every_rank_reported=True)) is Settle.FILLED
    assert book.end(2, TaskOutcome(2, Outcome.FAILED, "rank 1: bad ids", every_rank_reported=True)) is Settle.FREED
    assert book.end(3, TaskOutcome(3, Outcome.FAILED, "rank 1 died")) is Settle.HELD
    assert book.pool(Tier.CPU).num_used == 2 and book.held() == {Tier.CPU: 1}
    with pytest.raises(HeldRowError):
        book.give_back(Tier.CPU, c)  # not the owner's any more
    assert [f.task for f in book.settle([3])] == [3]
    assert book.give_back(Tier.CPU, a) and book.pool(Tier.CPU).num_free == 4
    book.check()


def test_a_row_given_back_while_a_task_reads_it_is_free_once_the_task_is_over():
    book = RowBook({Tier.CPU: 2, Tier.DISK: 2})
    cpu, disk = book.take(Tier.CPU, 1), book.take(Tier.DISK, 1)
    book.begin(5, writes={Tier.DISK: disk}, reads={Tier.CPU: cpu})  # a spill
    book.give_back(Tier.CPU, cpu)  # its key was forgotten meanwhile
    book.give_back(Tier.DISK, disk)
    assert book.held() == {Tier.CPU: 1, Tier.DISK: 1} and book.pool(Tier.CPU).num_free == 1
    assert book.end(5, TaskOutcome(5, Outcome.TIMEOUT, "")) is Settle.HELD
    assert book.held() == {Tier.CPU: 0, Tier.DISK: 1}, "a late read spoils only the task's own held writes"
    book.settle([5])
    assert book.pool(Tier.CPU).num_free == 2 and book.pool(Tier.DISK).num_free == 2
    book.check()


def test_fences_end_when_their_engine_says_and_share_a_row_with_a_spill():
    """An engine's jobs in flight at a reset and a spill reading the same row: free when both are over."""
    book = RowBook({Tier.CPU: 2, Tier.DISK: 2})
    cpu, disk = book.take(Tier.CPU, 1), book.take(Tier.DISK, 1)
    book.begin(11, writes={Tier.DISK: disk}, reads={Tier.CPU: cpu})
    book.begin(Fence(1), reads={Tier.CPU: cpu}, kind=TaskKind.FENCE)
    book.give_back(Tier.CPU, cpu)
    book.give_back(Tier.DISK, disk)
    assert [f.task for f in book.flights(TaskKind.FENCE)] == [Fence(1)]
    assert book.finish(Fence(1), copied=True) is Settle.FILLED
    assert book.held() == {Tier.CPU: 1, Tier.DISK: 1}, "the spill still reads the row"
    assert book.end(11, TaskOutcome(11, Outcome.OK, "", every_rank_reported=True)) is Settle.FILLED
    assert book.pool(Tier.CPU).num_free == 2 and book.pool(Tier.DISK).num_free == 2
    book.check()


def test_a_renewed_tier_keeps_out_of_reach_what_a_late_copy_may_write():
    book = RowBook({Tier.GPU: 3})
    rows = book.take(Tier.GPU, 2)
    book.begin(1, writes={Tier.GPU: rows})
    book.end(1, TaskOutcome(1, Outcome.TIMEOUT, ""))
    book.renew(Tier.GPU, 3)
    assert book.generation(Tier.GPU) == 1 and book.let_go(Tier.GPU) == sorted(rows)
    assert book.take(Tier.GPU, 1) not in ([rows[0]], [rows[1]])
    book.settle([1])
    assert book.pool(Tier.GPU).num_free == 2
    book.check()


def test_a_key_serving_on_a_row_is_one_fact_taken_twice():
    book = RowBook({Tier.CPU: 2})
    book.serve(Tier.CPU, b"a", 0)
    book.unserve(Tier.CPU, [b"a"])
    book.unserve(Tier.CPU, [])  # nothing to say: no event
    assert [(c.key, c.row) for c in book.take_changes()] == [(b"a", 0), (b"a", None)]
    assert [(e.keys, e.removed) for e in book.take_events()] == [([b"a"], False), ([b"a"], True)]
    assert book.take_events() == [] and book.take_changes() == []


@pytest.mark.parametrize("row", [-1, 99, True, 2.0])
def test_foreign_ids_are_refused(row):
    book = RowBook(SIZES, RESERVED)
    book.take(Tier.GPU, 2)
    with pytest.raises(ForeignBlockError):
        book.give_back(Tier.GPU, [row])
    assert book.pool(Tier.GPU).num_used == 2


def test_a_row_sent_beyond_the_book_stays_the_owners_and_touched_until_the_task_settles():
    book = RowBook({Tier.CPU: 2})
    row = book.take(Tier.CPU, 1)
    book.begin(3, sends={Tier.CPU: row})  # a put: the row's bytes go into a store other engines read
    assert book.end(3, TaskOutcome(3, Outcome.TIMEOUT, "")) is Settle.HELD
    assert book.touched(Tier.CPU, row[0]) and book.held() == {Tier.CPU: 0}, "still the owner's, and not to reuse"
    book.settle([3])
    assert not book.touched(Tier.CPU, row[0])
    book.begin(4, sends={Tier.CPU: row})
    assert book.end(4, TaskOutcome(4, Outcome.FAILED, "store_down", every_rank_reported=True)) is Settle.FREED
    assert not book.touched(Tier.CPU, row[0]) and book.pool(Tier.CPU).num_used == 1, "a failed put keeps the row"
    book.check()
