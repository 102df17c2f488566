"""Where a rank's cache stands in its clear/resume cycle, as the rank's core
sees it (sans-IO: the memory itself is ``store.BlockStore``'s, on the
executor thread).

A clear frees the cache and a resume allocates it, each as one piece of
work on the executor; the core must refuse tasks while there is no cache,
hold a clear's or resume's ack until its work is reported, and fail a
resume whose allocation failed (docs/protocol.md §6).  ``CacheState`` keeps
the phase and what the acks repeat: the failure's reason, the bytes the
last clear freed, whether the last allocation kept the CPU tier.
"""

from __future__ import annotations

from enum import Enum

from ..wire import protocol as P


class CachePhase(Enum):
    """The cache's phase.

    SERVING: memory is allocated; tasks run.  FREEING: a clear's free is on
    the executor; tasks are refused and the clear's ack waits.  FREED: the
    free was reported; tasks are refused until a resume.  ALLOCATING: a
    resume's allocation is on the executor; tasks queued behind it run on the
    new memory, the resume's ack waits.  ALLOC_FAILED: the last free or
    allocation raised (``CacheState.error`` says why): no cache, tasks are
    refused, the resume fails, the next resume allocates again.

    ``serves``: tasks may be given to the executor (memory is there, or will
    be before they run).  ``busy``: a free or allocation is not yet reported.
    Both are plain attributes: the task path reads ``serves`` per task."""

    SERVING = "serving"
    FREEING = "freeing"
    FREED = "freed"
    ALLOCATING = "allocating"
    ALLOC_FAILED = "alloc_failed"

    def __init__(self, value: str) -> None:
        self.serves = value in ("serving", "allocating")
        self.busy = value in ("freeing", "allocating")


class CacheState:
    """The cache's phase and what the acks repeat (see the module docstring)."""

    __slots__ = ("phase", "error", "freed", "cpu_kept", "queued")

    def __init__(self) -> None:
        self.phase = CachePhase.SERVING  # a rank starts on memory it holds
        self.error = ""  # why the last free or allocation failed (the resume ack repeats it)
        self.freed = 0  # bytes the last clear freed, repeated in every clear ack
        self.cpu_kept: bool | None = None  # whether the last allocation kept the CPU tier
        self.queued = 0  # frees and allocations on the executor, not yet reported

    def clear(self) -> bool:
        """A new clear: whether memory must be freed (it is held, or being allocated)."""
        self.freed = 0
        if not self.phase.serves:
            return False
        self.phase = CachePhase.FREEING
        self.queued += 1
        return True

    def allocate(self) -> None:
        """A resume's allocation goes to the executor."""
        self.phase = CachePhase.ALLOCATING
        self.error = ""
        self.cpu_kept = None
        self.queued += 1

    def done(self, freed: int, error: str, cpu_kept: bool | None) -> None:
        """The executor reported a free or allocation (in the order they were
        queued).  Only the report of the last one queued ends the phase: an
        earlier one belongs to an op a later clear or resume overtook (an
        allocation still queued when a failed resume rolled back), and
        neither its error nor its success may answer the later op.  A
        failure leaves no cache; a success ends the operation in progress."""
        self.freed += freed
        self.queued = max(0, self.queued - 1)
        if self.queued:
            return
        if error:
            self.phase = CachePhase.ALLOC_FAILED
            self.error = P.clamp(error)  # the resume ack repeats it: within the str bound (§2.1)
            return
        self.cpu_kept = cpu_kept
        if self.phase is CachePhase.FREEING:
            self.phase = CachePhase.FREED
        elif self.phase is CachePhase.ALLOCATING:
            self.phase = CachePhase.SERVING
