"""A control request that arrives while an op is in progress
(docs/protocol.md §8.1): it joins the op, and gets the op's reply, only when
it asks for what the op does; any other request is refused, never told
``ok`` for something it did not get.  A joiner whose own ``timeout_ms``
ends before the op's deadline is answered at its own deadline."""

from __future__ import annotations

from typing import Union

from ..wire.layout import CacheLayout
from ..wire.messages import Clear, Pause, Resume
from .actions import Action, error
from .admission import Refusal, merged_layout
from .records import PendingOp
from .state import ControlOp

Request = Union[Pause, Clear, Resume]  # a client's control request


def _named(layout: CacheLayout | None) -> str:
    return f"layout {layout.to_wire()}" if layout is not None else "the bus's layout"


def join_refusal(
    pending: PendingOp,
    op: ControlOp,
    msg: Request,
    current: CacheLayout | None,
    keep_cpu: bool,
    weights: str | None = None,
) -> Refusal | None:
    """None when ``msg`` may join ``pending``, else why not: a failed resume
    rolling back, another op, or the same op asking for something else (a
    resume naming another layout, a clear with another ``keep_cpu``).
    ``current``: the bus's layout (a resume's changes merge over it);
    ``keep_cpu``: the clear in progress keeps the CPU tier; ``weights``: the name it gave the weights."""
    if pending.failure is not None:
        return Refusal("busy", "a failed resume is rolling back on the ranks; retry when it completes")
    if pending.op != op:
        return Refusal("busy", f"{pending.op} epoch {pending.epoch} is in progress; retry when it completes")
    if isinstance(msg, Resume) and msg.layout is not None:
        try:
            wanted = merged_layout(msg.layout, current)
        except Refusal as refusal:  # an invalid layout is refused as such, whatever is in progress
            return refusal
        if wanted != pending.layout:
            return Refusal(
                "busy",
                f"resume epoch {pending.epoch} to {_named(pending.layout)} is in progress, not to "
                f"{_named(wanted)}; another layout needs a clear once it completes",
            )
    if isinstance(msg, Clear) and bool(msg.keep_cpu) != keep_cpu:
        return Refusal(
            "busy",
            f"clear epoch {pending.epoch} with keep_cpu={keep_cpu} is in progress; retry when it completes",
        )
    if isinstance(msg, Clear) and msg.weights is not None and msg.weights != weights:
        return Refusal(
            "busy",
            f"clear epoch {pending.epoch} naming the weights {weights!r} is in progress; retry when it completes",
        )
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


def due_joiner_errors(op: PendingOp, now: float, lagging: list[int]) -> list[Action]:
    """A joiner whose own deadline passed gets its ``<op>_timeout`` (or the
    failed resume's error) then; the op goes on for the rest.  ``lagging``:
    the ranks that have not acked the op's epoch."""
    out: list[Action] = []
    for client, req in take_due_joiners(op, now):
        if op.failure is not None:
            out.append(error(client, *op.failure, req=req))
            continue
        reason = (
            f"ranks {lagging} did not acknowledge {op.op} epoch {op.epoch} "
            f"within this request's timeout_ms; the {op.op} is still in progress"
        )
        out.append(error(client, f"{op.op}_timeout", reason, req=req))
    return out
