"""A control request that arrives while an op is in progress
(docs/protocol.md §8.1): it joins an op of its own kind, and gets the op's
reply; any other request is refused.  A joiner whose own ``timeout_ms``
ends before the op's deadline is answered at its own deadline."""

from __future__ import annotations

from typing import Union

from ..wire.messages import Clear, Pause, Resume
from .admission import Refusal
from .records import PendingOp
from .state import ControlOp

Request = Union[Pause, Clear, Resume]  # a client's control request


def join_refusal(pending: PendingOp, op: ControlOp) -> Refusal | None:
    """None when a request for ``op`` may join ``pending``, else why not: a failed resume
    rolling back, or another op."""
    if pending.failure is not None:
        return Refusal("busy", "a failed resume is rolling back on the ranks; retry when it completes")
    if pending.op != op:
        return Refusal("busy", f"{pending.op} epoch {pending.epoch} is in progress; retry when it completes")
    return None


def join(pending: PendingOp, client: bytes, req: int, deadline: float) -> None:
    """Answer ``req`` with the op's reply; by ``deadline`` at the latest."""
    pending.waiters.append((client, req))
    if deadline < pending.deadline:  # answered by its own deadline, even if the op goes on
        pending.joined[(client, req)] = deadline


def take_due_joiners(pending: PendingOp, now: float) -> list[tuple[bytes, int]]:
    """The joiners whose own deadline passed, no longer waiting on the op."""
    due = [key for key, deadline in pending.joined.items() if now >= deadline]
    for key in due:
        del pending.joined[key]
        pending.waiters.remove(key)
    return due
