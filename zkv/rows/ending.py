"""What a task's outcome does to the rows it writes: one rule, ``settle_of``,
for every engine path (docs/architecture.md, "One book of rows").

A task runs on every rank; each rank copies its own shard.  Its destination
rows are safe to hand out again only once no rank can still write them:

- ``ok``: every rank reported its copy done; the rows hold what the task
  wrote (``FILLED``, they stay with their owner);
- any other outcome whose copies are over (the broker never dispatched it,
  or every rank reported): nothing writes them any more (``FREED``);
- any other outcome a rank did not report (a timeout, a rank that died while
  the others were still copying, a generation move heard before the last
  result): a copy may still land (``HELD``, out of reach until the task
  *settles*: its missing ranks report late, or the bus drains).

The rule reads the outcome itself (``TaskOutcome.copies_over``), never a
caller's guess, so no owner can free what another would hold."""

from __future__ import annotations

import enum

from ..wire.outcome import TaskOutcome


class Settle(str, enum.Enum):
    """What an ended task's destination rows are now."""

    FILLED = "filled"  # they hold what the task wrote: their owner's
    FREED = "freed"  # nothing writes them any more: back in the pool
    HELD = "held"  # a copy may still land: out of reach until the task settles

    @property
    def lets_go(self) -> bool:
        """Whether the owner loses the rows (it must forget them, never give them back)."""
        return self is not Settle.FILLED


def settle_of(outcome: TaskOutcome) -> Settle:
    """The one rule (see the module docstring)."""
    if outcome.ok:
        return Settle.FILLED
    return Settle.FREED if outcome.copies_over else Settle.HELD
