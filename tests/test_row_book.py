"""The book of tier rows (zkv/rows/book.py), driven by a model of its owners.

A hypothesis state machine plays an engine path over a ``RowBook`` of a GPU,
a CPU and a disk tier: it takes rows, writes them through tasks whose
outcomes come in every order (ok, failed, cancelled, rejected, timeout, and a
late write of a timed-out task, then its settlement), serves what it filled,
evicts, clears with and without keeping the CPU tier (a generation move of
the GPU tier alone, or of every tier), restarts (a new book) and misuses the
book (a double free, a foreign id, a give-back under an old generation).
Beside the book it keeps what each row's memory holds: which task wrote it,
under which generation.  After every step it checks:

- no row handed out twice: the rows the owner holds, the rows held for late
  tasks and the free rows are every row of the tier, each once;
- no double free: a give-back of a free or held row raises and changes nothing;
- no row served that its holder did not write under the current generation,
  even when a timed-out task writes late;
- no leak: once every task has settled and every key is evicted, every row is free.

``ZKV_BOOK_EXAMPLES`` sets how many histories run (default 150; the long
profile in docs/architecture.md uses 3000).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zkv.rows import (
    DoubleFreeError,
    ForeignBlockError,
    HeldRowError,
    Loss,
    OutOfBlocksError,
    RowBook,
    may_write_late,
)
from zkv.wire.vocab import Outcome, Tier

SIZES = {Tier.GPU: 5, Tier.CPU: 6, Tier.DISK: 4}
RESERVED = {Tier.GPU: (0,)}  # an engine's own row (vLLM's null block): never handed out
TIERS = tuple(SIZES)
#: every outcome, ok and timeout twice (the outcomes that leave rows filled or held)
OUTCOMES = [*Outcome.__members__.values(), Outcome.OK, Outcome.TIMEOUT]
EXAMPLES = int(os.environ.get("ZKV_BOOK_EXAMPLES", "150"))


class BookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._fresh()
        self.next_task = 1

    # --- the model ---------------------------------------------------------------

    def _fresh(self) -> None:
        self.book = RowBook(SIZES, RESERVED)
        self.memory: dict[str, dict[int, tuple[int, int] | None]] = {
            t: dict.fromkeys(range(n)) for t, n in SIZES.items()
        }
        self.empty: dict[str, set[int]] = {t: set() for t in TIERS}  # taken, nothing written yet
        self.filled: dict[str, dict[int, tuple[int, int]]] = {t: {} for t in TIERS}  # row -> (writer, gen)
        self.running: dict[int, tuple[str, list[int]]] = {}  # a task writing rows the owner holds
        self.late: dict[int, tuple[str, list[int], int]] = {}  # a timed-out task: its rows, its generation

    def has_something_to_lose(self) -> bool:
        """Restarts, clears and moves only once rows are filled or held (else they would
        wipe the state too often for tasks to reach their outcomes)."""
        return bool(self.late) or any(self.filled.values())

    def running_rows(self, tier: str) -> list[int]:
        return [row for t, rows in self.running.values() if t == tier for row in rows]

    @precondition(has_something_to_lose)
    @rule()
    def restart(self) -> None:
        """A process restart: a new book, nothing of the old one served (memory is fresh too)."""
        self._fresh()

    # --- rows --------------------------------------------------------------------

    @rule(tier=st.sampled_from(TIERS), count=st.integers(0, 4), write=st.booleans())
    def take(self, tier: str, count: int, write: bool) -> None:
        """Take rows, for a task that writes them at once (a store, a swap) or for later."""
        free_before = self.book.pool(tier).num_free
        if count > free_before:
            with pytest.raises(OutOfBlocksError):
                self.book.take(tier, count)
            assert self.book.pool(tier).num_free == free_before, "a refused take changed the pool"
            return
        rows = self.book.take(tier, count)
        assert len(set(rows)) == count
        owned = self.empty[tier] | set(self.filled[tier]) | set(self.running_rows(tier))
        assert owned.isdisjoint(rows), f"{tier}: rows {sorted(owned & set(rows))} handed out twice"
        assert not set(rows) & set(RESERVED.get(tier, ())), "a reserved row handed out"
        if write and rows:
            self.running[self.next_task] = (tier, rows)
            self.next_task += 1
        else:
            self.empty[tier].update(rows)

    @precondition(lambda self: any(self.empty.values()))
    @rule(data=st.data())
    def start_task(self, data: st.DataObject) -> None:
        """A task begins writing some of the empty rows the owner took."""
        tier = data.draw(st.sampled_from([t for t in TIERS if self.empty[t]]))
        rows = data.draw(st.lists(st.sampled_from(sorted(self.empty[tier])), min_size=1, unique=True))
        self.empty[tier].difference_update(rows)
        self.running[self.next_task] = (tier, rows)
        self.next_task += 1

    @precondition(lambda self: self.running)
    @rule(
        data=st.data(),
        outcome=st.sampled_from(OUTCOMES),
        ranks_reported=st.booleans(),
        ran=st.sampled_from([True, False, None]),
    )
    def end_task(self, data: st.DataObject, outcome: str, ranks_reported: bool, ran: bool | None) -> None:
        task = data.draw(st.sampled_from(sorted(self.running)))
        tier, rows = self.running.pop(task)
        gen = self.book.generation(tier)
        if outcome == Outcome.OK:
            for row in rows:  # the copy landed before the outcome came
                self.memory[tier][row] = (task, gen)
                self.filled[tier][row] = (task, gen)
        elif may_write_late(outcome, ran, ranks_reported):
            self.book.hold(task, {tier: rows})
            self.late[task] = (tier, rows, gen)
        else:
            assert self.book.give_back(tier, rows, gen)

    @precondition(lambda self: self.late)
    @rule(data=st.data(), settle=st.booleans())
    def late_write(self, data: st.DataObject, settle: bool) -> None:
        """A slow rank copies at last (into rows the book still holds), then the bus
        says the task settled (or not yet)."""
        task = data.draw(st.sampled_from(sorted(self.late)))
        tier, rows, gen = self.late[task]
        if gen == self.book.generation(tier):  # after a generation move no copy runs: the bus drained first
            for row in rows:
                self.memory[tier][row] = (task, gen)
        if settle:
            del self.late[task]
            freed = self.book.settle([task])
            assert [e.task for e in freed] == ([task] if gen == self.book.generation(tier) else [])

    @precondition(lambda self: any(self.filled.values()))
    @rule(data=st.data())
    def serve(self, data: st.DataObject) -> None:
        """Read a filled row: its memory holds exactly what its holder wrote, under this generation."""
        tier = data.draw(st.sampled_from([t for t in TIERS if self.filled[t]]))
        row = data.draw(st.sampled_from(sorted(self.filled[tier])))
        writer = self.filled[tier][row]
        assert writer[1] == self.book.generation(tier), "a row of an older generation is served"
        assert self.memory[tier][row] == writer, f"{tier} row {row} holds {self.memory[tier][row]}, not {writer}"

    @precondition(lambda self: any(self.filled.values()) or any(self.empty.values()))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        tier = data.draw(st.sampled_from([t for t in TIERS if self.filled[t] or self.empty[t]]))
        rows = data.draw(st.lists(st.sampled_from(sorted(set(self.filled[tier]) | self.empty[tier])), unique=True))
        assert self.book.give_back(tier, rows)
        for row in rows:
            self.filled[tier].pop(row, None)
            self.empty[tier].discard(row)

    # --- misuse ------------------------------------------------------------------

    @rule(tier=st.sampled_from(TIERS), data=st.data())
    def double_free_is_refused(self, tier: str, data: st.DataObject) -> None:
        held = {row for t, rows, _ in self.late.values() if t == tier for row in rows}
        not_mine = sorted(set(self.book.free_rows(tier)) | held)
        if tier in RESERVED:
            not_mine += RESERVED[tier]
        if not not_mine:
            return
        row = data.draw(st.sampled_from(not_mine))
        before = (self.book.free_rows(tier), self.book.held())
        with pytest.raises((DoubleFreeError, ForeignBlockError, HeldRowError)):
            self.book.give_back(tier, [row])
        assert (self.book.free_rows(tier), self.book.held()) == before, "a refused give-back changed the book"

    @precondition(lambda self: self.late)
    @rule(data=st.data())
    def a_held_row_is_not_the_owners_to_give_back(self, data: st.DataObject) -> None:
        tier, rows, _ = self.late[data.draw(st.sampled_from(sorted(self.late)))]
        before = (self.book.free_rows(tier), self.book.held())
        with pytest.raises(HeldRowError):
            self.book.give_back(tier, rows)
        assert (self.book.free_rows(tier), self.book.held()) == before, "a refused give-back changed the book"

    @precondition(lambda self: any(self.filled.values()))
    @rule(data=st.data())
    def give_back_under_an_old_generation_changes_nothing(self, data: st.DataObject) -> None:
        tier = data.draw(st.sampled_from([t for t in TIERS if self.filled[t]]))
        before = self.book.free_rows(tier)
        assert self.book.give_back(tier, sorted(self.filled[tier]), self.book.generation(tier) - 1) is False
        assert self.book.free_rows(tier) == before

    # --- clears and generation moves ---------------------------------------------

    @precondition(has_something_to_lose)
    @rule(keep_cpu=st.booleans())
    def clear(self, keep_cpu: bool) -> None:
        """The bus drained, then cleared: the GPU rows go (and the CPU and disk rows unless
        kept); tasks still held on a kept tier settle, being drained."""
        self.move(Loss.GPU if keep_cpu else Loss.ALL)
        for entry in self.book.release_held():
            del self.late[entry.task]  # type: ignore[arg-type]
        assert not self.late

    @precondition(has_something_to_lose)
    @rule(loss=st.sampled_from([Loss.GPU, Loss.ALL]))
    def move(self, loss: Loss) -> None:
        """The bus's generations moved without our clear (a rank restarted on fresh
        memory): the tiers it took start afresh; held tasks of a kept tier stay held."""
        for tier in TIERS:
            if not loss.took(tier):
                continue
            self.book.renew(tier, SIZES[tier], RESERVED.get(tier, ()))
            self.memory[tier] = dict.fromkeys(range(SIZES[tier]))
            self.empty[tier].clear()
            self.filled[tier].clear()
            for task in [t for t, (tt, _) in self.running.items() if tt == tier]:
                del self.running[task]  # the owner forgets rows of a lost generation
        for task in [t for t, (tier, _, _) in self.late.items() if loss.took(tier)]:
            del self.late[task]
            assert not self.book.is_holding(task), "a late task's rows outlived their generation"

    # --- what must hold ----------------------------------------------------------

    @invariant()
    def every_row_once(self) -> None:
        self.book.check()
        for tier, n in SIZES.items():
            running = self.running_rows(tier)
            held = [r for t, rs, _ in self.late.values() if t == tier for r in rs]
            every = [*self.empty[tier], *self.filled[tier], *running, *held, *self.book.free_rows(tier)]
            every += RESERVED.get(tier, ())
            assert sorted(every) == list(range(n)), f"{tier}: {sorted(every)}"
            assert self.book.held()[tier] == len(held)

    @invariant()
    def filled_rows_hold_what_their_holder_wrote(self) -> None:
        for tier in TIERS:
            for row, writer in self.filled[tier].items():
                assert self.memory[tier][row] == writer, f"{tier} row {row}: a late task wrote a reused row"

    def teardown(self) -> None:
        """No leak: settle every late task, evict everything, and every row is free."""
        self.book.release_held()
        for tier in TIERS:
            rows = [*self.empty[tier], *self.filled[tier], *self.running_rows(tier)]
            self.book.give_back(tier, rows)
            assert self.book.pool(tier).num_free == SIZES[tier] - len(RESERVED.get(tier, ())), f"{tier} leaked"


TestRowBook = BookMachine.TestCase
TestRowBook.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_a_held_task_is_refused_twice_and_a_free_row_cannot_be_held():
    book = RowBook({Tier.CPU: 3})
    rows = book.take(Tier.CPU, 2)
    book.hold(7, {Tier.CPU: rows[:1]})
    with pytest.raises(HeldRowError):
        book.hold(7, {Tier.CPU: rows[1:]})
    with pytest.raises(HeldRowError):
        book.hold(8, {Tier.CPU: [2]})  # never taken
    with pytest.raises(HeldRowError):
        book.hold(9, {Tier.CPU: rows[:1]})  # held by task 7 already
    book.check()


def test_renew_keeps_what_a_task_holds_on_other_tiers():
    book = RowBook({Tier.CPU: 2, Tier.DISK: 2})
    cpu, disk = book.take(Tier.CPU, 1), book.take(Tier.DISK, 1)
    book.hold(("spill", b"k", disk[0]), {Tier.CPU: cpu, Tier.DISK: disk})
    assert book.renew(Tier.DISK, 2) == 0  # still holds its CPU row
    assert book.held() == {Tier.CPU: 1, Tier.DISK: 0} and book.generation(Tier.DISK) == 1
    assert [e.num_rows for e in book.settle([("spill", b"k", disk[0])])] == [1]
    assert book.pool(Tier.CPU).num_free == 2 and book.pool(Tier.DISK).num_free == 2
    book.check()


def test_events_are_handed_over_once():
    book = RowBook({Tier.CPU: 1})
    book.announce(Tier.CPU, [b"a"], removed=False)
    book.announce(Tier.CPU, [], removed=True)  # nothing to say: no event
    assert [(e.keys, e.removed) for e in book.take_events()] == [([b"a"], False)]
    assert book.take_events() == []


@pytest.mark.parametrize("row", [-1, 99, True, 2.0])
def test_foreign_ids_are_refused(row):
    book = RowBook(SIZES, RESERVED)
    book.take(Tier.GPU, 2)
    with pytest.raises(ForeignBlockError):
        book.give_back(Tier.GPU, [row])
    assert book.pool(Tier.GPU).num_used == 2
