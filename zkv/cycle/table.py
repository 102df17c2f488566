"""The cycle as a table (docs/engine-vllm.md, "The RL cycle"): the steps an
engine goes through before the fleet's decision, the steps after a commit,
and what a rollback runs for each forward step that started.  The core
(``core.py``) reads these rows; nothing else orders steps.

Rule 1: a row says *whether* a lane runs a step (``when``, a function of the
plan and the engine) and *what undoes it* (``undo``); when a step's result
forbids the next ones (a prefix cache that was not reset, weights nobody
knows), that is a gate here too, never a condition written in the core.

Rule 2: rollback steps run in ``ROLLBACK_ORDER``, each once, whatever the
order their forward steps ran in: the weights first, then the bus, the
prefix cache, serving again, and the old label last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .terms import Step


@dataclass(frozen=True)
class Shape:
    """What the rows depend on for one lane: the plan's choices and the engine's kind."""

    sleep: bool  # sleep and wake instead of pause and resume
    measuring: bool  # the caller said the weights do not change: measured before and after
    clears_first: bool  # the engine's bus is cleared before the update (zkv owns memory the update needs)
    keep_tiers: bool = False  # known at the commit: every engine measured unchanged
    again: bool = False  # the tail an earlier driver may have run in part: the bus may be running again


@dataclass(frozen=True)
class Row:
    step: Step
    when: Callable[[Shape], bool] = lambda s: True
    undo: tuple[Step, ...] = ()


#: Before the fleet's decision: each lane runs these in order, then waits for the others.
FORWARD: tuple[Row, ...] = (
    Row(Step.CLAIM, undo=(Step.LABEL,)),
    # The engine first: a bus pause acks once its ranks finished their copies, and a rank runs in
    # the engine's own worker process, which answers at once only when the engine stops computing.
    Row(Step.PAUSE, lambda s: not s.sleep, undo=(Step.RESET, Step.RESUME)),
    Row(Step.SLEEP, lambda s: s.sleep, undo=(Step.RESET, Step.WAKE_UP)),
    Row(Step.PAUSE_BUS, undo=(Step.RESUME_BUS,)),
    Row(Step.CLEAR_BUS, lambda s: s.clears_first, undo=(Step.RESUME_BUS,)),
    Row(Step.CHECKSUM_BEFORE, lambda s: s.measuring),
    Row(Step.UPDATE, undo=(Step.ROLLBACK_WEIGHTS,)),
    Row(Step.CHECKSUM_AFTER, lambda s: s.measuring),
)

#: After a commit: only forward; a failure leaves the lane for the finishing command.  The commit is
#: recorded before the tiers are dropped (after that a rollback could not give them back); the bus
#: serves again before the engine does (its ranks ack while the engine is idle).
TAIL: tuple[Row, ...] = (
    Row(Step.COMMIT),
    Row(Step.PAUSE_BUS, lambda s: s.again and not s.clears_first),
    Row(Step.DROP_TIERS, lambda s: not s.clears_first and not s.keep_tiers),
    Row(Step.KEEP_TIERS, lambda s: not s.clears_first and s.keep_tiers),
    Row(Step.RESUME_BUS),
    Row(Step.RESET),
    Row(Step.RESUME, lambda s: not s.sleep),
    Row(Step.WAKE_UP, lambda s: s.sleep),
    Row(Step.LABEL),
)

ROLLBACK_ORDER: tuple[Step, ...] = (
    Step.ROLLBACK_WEIGHTS,
    Step.RESUME_BUS,
    Step.RESET,
    Step.RESUME,
    Step.WAKE_UP,
    Step.LABEL,
)

#: Steps that talk to the engine (a lane whose engine is down skips them); the rest talk to its bus.
ENGINE_STEPS = frozenset(
    {
        Step.CLAIM,
        Step.PAUSE,
        Step.SLEEP,
        Step.CHECKSUM_BEFORE,
        Step.UPDATE,
        Step.CHECKSUM_AFTER,
        Step.COMMIT,
        Step.RESET,
        Step.RESUME,
        Step.WAKE_UP,
        Step.LABEL,
        Step.ROLLBACK_WEIGHTS,
    }
)
BUS_STEPS = frozenset({Step.PAUSE_BUS, Step.CLEAR_BUS, Step.DROP_TIERS, Step.KEEP_TIERS, Step.RESUME_BUS})
#: Steps that make an engine serve again (its pause window ends when one succeeds).
SERVE_AGAIN = frozenset({Step.RESUME, Step.WAKE_UP})
STOP = frozenset({Step.PAUSE, Step.SLEEP})
#: Steps after which the engine must not serve until the prefix cache is reset: a failed
#: reset keeps it paused (it would serve KV computed under other weights).
AFTER_RESET = frozenset({Step.RESUME, Step.WAKE_UP, Step.LABEL})


def forward(shape: Shape) -> list[Step]:
    return [r.step for r in FORWARD if r.when(shape)]


def tail(shape: Shape) -> list[Step]:
    return [r.step for r in TAIL if r.when(shape)]


def rollback(started: set[Step], may_be_new: bool) -> list[Step]:
    """The rollback of a lane whose forward steps ``started`` (``may_be_new``: an earlier
    driver's record said its update had started)."""
    undo = {u for r in FORWARD if r.step in started for u in r.undo}
    if may_be_new:
        undo.add(Step.ROLLBACK_WEIGHTS)
    return [s for s in ROLLBACK_ORDER if s in undo]
