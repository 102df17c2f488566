"""The client's aggregation rule for generation moves (docs/protocol.md §7.4,
§8.2), sans-IO: a move cancels exactly the open tasks that ran (or were
accepted) at an older generation; a task that ran at the new one ends with its
real outcome, however late the client learns of the move."""

from zkv.client.results import ResultBook
from zkv.testing.sim import Sim
from zkv.wire.messages import OutcomeMsg, Result


def result(task: int, rank: int, gen: int, outcome: str = "ok", world: int = 2) -> Result:
    return Result(task=task, rank=rank, world=world, outcome=outcome, reason="", gen=gen, bytes=10)


def book_at(gen: int, *tasks: int) -> ResultBook:
    """A book that knows ``gen`` (as from a status reply) with ``tasks`` open."""
    book = ResultBook()
    book.learn_gen(gen, "status", 0.0)
    for task in tasks:
        book.add(task, 0.0, 30.0)
    return book


def moved(book: ResultBook) -> dict[int, str]:
    out, book.moved = book.moved, []
    return {o.task: o.outcome for o in out}


def test_tasks_that_ran_at_the_new_generation_end_ok_when_their_results_teach_the_move():
    book = book_at(0, 1, 2, 3)
    assert book.on_result(result(1, 0, gen=0), 1.0) is None  # task 1 ran at generation 0
    # another connection paused, cleared and resumed; tasks 2 and 3 ran afterwards
    assert book.on_result(result(2, 1, gen=1), 2.0) is None
    assert book.gen == 1
    assert moved(book) == {1: "cancelled"}, "only the task that ran at generation 0"
    assert book.on_result(result(2, 0, gen=1), 2.0).outcome == "ok"
    assert book.on_result(result(3, 0, gen=1), 2.0) is None
    done = book.on_result(result(3, 1, gen=1), 2.0)
    assert done.outcome == "ok" and done.bytes == 20 and done.per_rank[1]["gen"] == 1
    assert book.counters["gen_changes"] == 1 and not book.open


def test_a_task_whose_results_are_of_a_generation_the_client_already_left_ends_cancelled():
    book = book_at(0, 1)
    assert book.learn_gen(1, "status says so", 1.0) == [], "no result yet: its own results will say"
    assert 1 in book.open
    assert book.on_result(result(1, 0, gen=0), 2.0) is None
    out = moved(book)
    assert out == {1: "cancelled"} and book.counters["old_gen_results"] == 1
    assert book.on_result(result(1, 1, gen=0), 2.0) is None and book.counters["late_results"] == 1


def test_a_result_older_than_the_generation_the_task_was_submitted_at_is_not_its_own():
    book = book_at(1, 1)
    assert book.on_result(result(1, 0, gen=0), 1.0) is None
    assert book.counters["stale_results"] == 1 and 1 in book.open and not book.moved
    book.on_result(result(1, 0, gen=1), 1.0)
    assert book.on_result(result(1, 1, gen=1), 1.0).outcome == "ok"


def test_a_task_whose_ranks_ran_at_two_generations_is_cancelled():
    book = book_at(0, 1)
    book.on_result(result(1, 0, gen=0), 1.0)
    assert book.on_result(result(1, 1, gen=1), 1.0) is None
    assert moved(book) == {1: "cancelled"} and book.gen == 1


def test_a_new_client_adopts_the_first_generation_and_cancels_what_ran_before_it():
    book = ResultBook()
    for task in (1, 2):
        book.add(task, 0.0, 30.0)
    book.on_result(result(1, 0, gen=3), 1.0)
    assert book.gen == 3 and not book.moved, "the first generation heard of is no move"
    assert book.on_result(result(1, 1, gen=3), 1.0).outcome == "ok"
    book.on_result(result(2, 0, gen=2), 1.0)  # it ran before the clear that made generation 3
    assert moved(book) == {2: "cancelled"}


def test_the_client_s_own_clear_ends_every_task_it_submitted_before():
    book = book_at(0, 1, 2)
    book.on_result(result(1, 0, gen=0), 1.0)
    ended = book.cleared(1, "cleared", 2.0)
    assert sorted((o.task, o.outcome) for o in ended) == [(1, "cancelled"), (2, "cancelled")]
    assert book.gen == 1 and book.cleared(1, "again", 2.0) == []
    book.add(3, 2.0, 30.0)
    book.on_result(result(3, 0, gen=1), 3.0)
    assert book.on_result(result(3, 1, gen=1), 3.0).outcome == "ok"


def test_an_outcome_ends_its_task_and_its_generation_cancels_only_older_tasks():
    book = book_at(0, 1, 2, 3)
    book.on_result(result(2, 0, gen=0), 1.0)
    done = book.on_outcome(1, "cancelled", "caches were cleared while the task was queued", 2.0, gen=0)
    assert done.outcome == "cancelled" and book.gen == 0 and not book.moved
    book.on_outcome(99, "rejected", "caches are cleared", 2.0, gen=1)  # not open: only its generation counts
    assert book.gen == 1 and moved(book) == {2: "cancelled"} and 3 in book.open


def test_the_broker_names_each_task_s_own_generation_in_its_outcome():
    sim = Sim().up()
    sim.request("pause")
    sim.settle()
    held = sim.submit()  # queued at generation 0
    sim.request("clear")
    sim.settle()
    rejected = sim.submit()  # the caches are cleared: turned away at generation 1
    outcomes = {m.task: m for m in sim.client_in if isinstance(m, OutcomeMsg)}
    assert sim.broker.gen == 1
    assert (outcomes[held].outcome, outcomes[held].gen) == ("cancelled", 0)
    assert (outcomes[rejected].outcome, outcomes[rejected].gen) == ("rejected", 1)
    sim.request("resume")
    sim.settle()
    ran = sim.submit()
    sim.settle()
    assert sim.outcomes[ran] == "ok" and [r.gen for r in sim.results if r.task == ran] == [1, 1]


def test_ran_says_whether_a_rank_ran_the_task_or_the_broker_never_dispatched_it():
    book = book_at(0, 1, 2, 3, 4)
    never = book.on_outcome(1, "timeout", "never dispatched", 1.0, 0, ran=False)
    assert never.outcome == "timeout" and never.ran is False and never.to_json()["ran"] is False
    book.on_result(result(2, 0, gen=0), 1.0)
    ran = book.on_result(result(2, 1, gen=0), 1.0)
    assert ran.ran is True
    died = book.on_outcome(3, "failed", "rank 1 died", 1.0, 0)  # dispatched: a rank may have copied
    assert died.ran is None
    (gave_up,) = [o for o in book.expire(31.0) if o.task == 4]  # the client's own deadline: nobody can say
    assert gave_up.outcome == "timeout" and gave_up.ran is None


def test_a_task_the_client_gave_up_on_settles_when_the_broker_says_it_never_ran():
    book = book_at(0, 7)
    (out,) = book.expire(31.0)
    assert out.outcome == "timeout" and book.take_settled() == []
    assert book.on_outcome(7, "timeout", "never dispatched", 31.1, 0, ran=False) is None  # late: not a second outcome
    assert book.take_settled() == [7], "no rank will write its blocks: they may be reused"
