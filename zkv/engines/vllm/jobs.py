"""When a vLLM worker may call an offload job finished (sans-IO).

vLLM counts a job done when every worker reported it; zkv runs the job as
one task on every rank.  A worker reports a job once *its own rank's* copy
is over, so no worker lets vLLM reuse (or compute on) GPU blocks its rank
still reads or writes:

- the worker of rank 0 submitted the task and waits for its outcome too: a
  job is finished when the outcome is in and this rank ran the task (or the
  outcome says no rank ever will: ``ran`` is False);
- any other worker reports when its rank ran the task.

A rank that never gets the task (the broker cancelled or timed it out while
queued) reports at the task's deadline plus ``grace``.  The grace must cover a
task that reached this rank but still waits in its queue (it runs there
later, in order): the worker gives as long as the task's own timeout, so that
vLLM does not recompute into GPU blocks a late copy would still write.  The job succeeded
only if the outcome (rank 0) or this rank's run (others) was ``ok``.

Sans-IO and single-threaded: the worker (``worker.py``) serializes the calls
(its rank's thread reports runs) and does the waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...wire.outcome import TaskOutcome
from ...wire.vocab import Outcome


@dataclass(kw_only=True)
class Job:
    """One vLLM job as one zkv task: its GPU blocks and zkv's CPU tier rows it writes
    (a store) or reads (a load), its bytes, when it started and its deadline."""

    job_id: int
    task: int
    is_store: bool
    gpu_ids: list[int]
    cpu_rows: list[int] = field(default_factory=list)
    nbytes: int
    started: float
    deadline: float
    outcome: TaskOutcome | None = None
    local: str | None = None  # this rank's own outcome of the task


@dataclass
class Finished:
    job: Job
    success: bool
    reason: str


@dataclass
class JobBook:
    """Jobs of one worker; ``submitter``: this worker's rank submits the tasks."""

    submitter: bool
    grace: float = 1.0
    jobs: dict[int, Job] = field(default_factory=dict)  # by zkv task id
    # Runs this rank finished before this worker heard of the job (the worker
    # of rank 0 may submit before the others were handed the same job).
    early: dict[int, str] = field(default_factory=dict)
    early_limit: int = 4096

    @staticmethod
    def task_of(job_id: int) -> int:
        """The task id every worker of the engine names job ``job_id`` by."""
        return job_id + 1

    def add(self, job: Job) -> None:
        job.local = self.early.pop(job.task, job.local)
        self.jobs[job.task] = job

    def on_local(self, task: int, outcome: str) -> None:
        """This rank ran ``task``."""
        job = self.jobs.get(task)
        if job is None:
            self.early[task] = outcome
            while len(self.early) > self.early_limit:
                del self.early[next(iter(self.early))]  # the oldest: a job no worker will add
            return
        job.local = outcome

    def on_outcome(self, out: TaskOutcome) -> None:
        job = self.jobs.get(out.task)
        if job is not None:
            job.outcome = out

    def _verdict(self, job: Job, now: float) -> Finished | None:
        late = now >= job.deadline + self.grace
        if self.submitter:
            out = job.outcome
            if out is None:
                return None
            if job.local is not None or out.ran is False or late:
                return Finished(job, out.ok and job.local in (None, Outcome.OK), out.reason)
            return None
        if job.local is not None:
            return Finished(job, job.local == Outcome.OK, f"this rank's copy ended {job.local}")
        if late:
            return Finished(job, False, "this rank never ran the task before its deadline")
        return None

    def take_finished(self, now: float) -> list[Finished]:
        done = [v for job in self.jobs.values() if (v := self._verdict(job, now)) is not None]
        for v in done:
            del self.jobs[v.job.task]
        return done

    def is_finished(self, task: int, now: float) -> bool:
        job = self.jobs.get(task)
        return job is None or self._verdict(job, now) is not None

    def wakes_at(self, task: int) -> float:
        """When ``task`` is finished for this worker whatever happens (its deadline and grace)."""
        job = self.jobs.get(task)
        return job.deadline + self.grace if job is not None else 0.0
