"""What the broker tells the ranks of the bus state (docs/protocol.md §10.1,
§10.4): the control message it publishes at each epoch and the welcome a
registering rank gets.  Both name the same state; kept side by side so
that they never drift apart."""

from __future__ import annotations

from typing import Any

from ..wire.layout import CacheLayout
from ..wire.messages import Control, Welcome
from .state import ControlOp


def _named(layout: CacheLayout | None, keep_cpu: bool) -> dict[str, Any]:
    named: dict[str, Any] = {}
    if layout is not None:
        named["layout"] = layout
    if keep_cpu:
        named["keep_cpu"] = True
    return named


def control_frame(
    epoch: int, op: ControlOp, gen: int, upto: list[int], layout: CacheLayout | None, keep_cpu: bool
) -> bytes:
    """The PUB control message: ``layout`` is a resume's, ``keep_cpu`` a clear's."""
    return Control(epoch=epoch, op=op, gen=gen, upto=upto, **_named(layout, keep_cpu)).to_wire()


def welcome_frame(
    epoch: int, op: ControlOp, gen: int, upto: int, layout: CacheLayout, heartbeat_ms: int, session: int, keep_cpu: bool
) -> bytes:
    """A registered rank's welcome; ``session`` echoes its ready's (§10.2)."""
    return Welcome(
        epoch=epoch,
        op=op,
        gen=gen,
        upto=upto,
        layout=layout,
        heartbeat_ms=heartbeat_ms,
        keep_cpu=True if keep_cpu else None,
        session=session,
    ).to_wire()
