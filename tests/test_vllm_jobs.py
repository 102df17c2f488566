"""When a vLLM worker may call an offload job finished (zkv/engines/vllm/jobs.py):
never while its own rank may still copy, always by the task's deadline."""

from __future__ import annotations

from zkv.engines.vllm.jobs import Job, JobBook
from zkv.wire.outcome import TaskOutcome


def job(task: int = 1, deadline: float = 10.0) -> Job:
    return Job(job_id=task - 1, task=task, is_store=False, gpu_ids=[3, 4], nbytes=0, started=0.0, deadline=deadline)


def test_the_submitter_waits_for_its_own_ranks_copy_after_a_failed_outcome():
    book = JobBook(submitter=True)
    book.add(job())
    book.on_outcome(TaskOutcome(1, "failed", "rank 1: bad ids", per_rank={1: {}}))
    assert book.take_finished(now=1.0) == [], "rank 0 may still be writing the GPU blocks"
    book.on_local(1, "ok")
    (done,) = book.take_finished(now=1.0)
    assert not done.success and done.reason == "rank 1: bad ids"


def test_a_task_that_never_ran_ends_at_once_for_the_submitter_and_at_the_deadline_for_the_others():
    sub, other = JobBook(submitter=True, grace=1.0), JobBook(submitter=False, grace=1.0)
    for book in (sub, other):
        book.add(job(deadline=5.0))
    sub.on_outcome(TaskOutcome(1, "timeout", "queued past its deadline", never_ran=True))
    assert [d.success for d in sub.take_finished(now=5.0)] == [False]
    assert other.take_finished(now=5.5) == []
    assert [d.success for d in other.take_finished(now=6.0)] == [False]


def test_a_run_before_the_job_was_handed_over_counts():
    book = JobBook(submitter=False)
    book.on_local(1, "ok")
    book.add(job())
    assert [d.success for d in book.take_finished(now=0.0)] == [True]


def test_early_runs_are_bounded():
    book = JobBook(submitter=False, early_limit=3)
    for task in range(10):
        book.on_local(task, "ok")
    assert sorted(book.early) == [7, 8, 9]
