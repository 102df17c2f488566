"""What a control request gets before any op starts: the reply of a request
the bus already satisfies (a noop), or the refusal of one it cannot start.
Pure functions of the bus state, so that the control machine only joins,
begins and ends ops."""

from __future__ import annotations

from typing import Any

from ..wire import bounds
from ..wire import protocol as P
from ..wire.layout import CacheLayout, LayoutChange
from ..wire.replies import ControlReply
from .actions import Action, answer_to
from .state import ALREADY, BusState, ControlOp

#: The op's own fields in a noop reply, in the order a real reply has them.
_NOOP_FIELDS: dict[ControlOp, dict[str, Any]] = {
    ControlOp.PAUSE: {"drain_ms": 0.0},
    ControlOp.CLEAR: {"cancelled": 0, "freed": 0},
    ControlOp.RESUME: {},
}
_NOOP_NOTE = {ControlOp.CLEAR: "already cleared", ControlOp.RESUME: "already running"}


class Refusal(Exception):
    """A request the bus cannot start: answered ``error{code, reason}``."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def noop_reply(op: ControlOp, client: bytes, req: int, state: BusState, epoch: int, gen: int) -> Action | None:
    """The reply to ``op`` on a bus already in the state it asks for, else None."""
    if state not in ALREADY[op]:
        return None
    note = _NOOP_NOTE.get(op, f"already {state}")
    return answer_to(client, ControlReply(req, control=op, noop=True, state=state, epoch=epoch, gen=gen, note=note))


def check_clear(state: BusState, gen: int = 0) -> None:
    """A clear frees memory only on a paused bus (every rank drained), and
    moves the generation only within its bound (bounds.py: room for the
    clear and for the roll-back of a failed resume after it)."""
    if state != BusState.PAUSED:
        raise Refusal("not_paused", "clear needs a paused bus: run zkv pause first")
    if not bounds.gen_room(gen, 2):
        raise Refusal("gen_exhausted", f"cache generation {gen} is at its maximum {bounds.MAX_GEN}: no clear follows")


def resume_layout(named: LayoutChange | None, state: BusState, current: CacheLayout | None) -> CacheLayout | None:
    """The layout a resume names, decoded once (always named, so that no rank
    resumes on another layout): the current one, or the request's changes
    over it.  Changes need cleared caches, also on a running bus (a noop
    would say ``ok`` to a layout the ranks do not get); a layout equal to
    the bus's changes nothing and is taken in any state."""
    if named is None:
        return current
    wanted = merged_layout(named, current)
    if wanted != current and state != BusState.CLEARED:
        first = "zkv clear" if state == BusState.PAUSED else "zkv pause and zkv clear"
        raise Refusal(
            "not_cleared", f"the bus is {state}: a layout other than the bus's needs cleared caches; run {first} first"
        )
    return wanted


def merged_layout(named: LayoutChange, current: CacheLayout | None) -> CacheLayout:
    """A resume's layout changes over the bus's ``current`` layout; ``bad_field`` if invalid."""
    try:
        return named.over(current or CacheLayout())
    except P.ProtocolError as err:
        raise Refusal("bad_field", f"resume layout: {err}") from None
