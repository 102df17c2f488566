"""What a rank's executor reports to its I/O thread, one slotted value per
kind: a task's end (``Finished``, which the core books with
``RankCore.on_finished``) and a cache operation's (``CacheDone``, for
``RankCore.on_cache_done``).  Made per task, so slotted, not frozen
(rank/actions.py); treat them as values all the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..wire.vocab import RankOutcome


@dataclass(slots=True)
class Finished:
    """A task's end as the rank's core books it."""

    seq: int
    n: int
    outcome: RankOutcome  # ok or failed
    nbytes: int
    gen: int


@dataclass(slots=True)
class CacheDone:
    """A FreeCache or AllocateCache done: bytes freed, whether the CPU tier was
    kept (an allocation), or why it failed."""

    freed: int = 0
    cpu_kept: bool | None = None
    error: str = ""


Report = Union[Finished, CacheDone]
