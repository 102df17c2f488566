"""The bus states and their transitions, as data.

Rule 1: everything that decides which state the bus is in, and which state a
control operation moves it to (on success, on failure, across a broker
restart), lives here in this file, as tables where it fits.  ``core.py``,
``control.py`` and ``recovery.py`` look the next state up here; they never
spell a state as a string.

Rule 2: this file knows nothing of clients, ranks, epochs or sockets; it knows
only the control cycle in the abstract (pause -> clear -> resume).

The ops and the states are the wire's own words, ``ControlOp`` and
``BusState`` (``zkv/wire/vocab.py``), re-exported here for the tables'
readers: a state or op packs, prints and compares as its value.
"""

from __future__ import annotations

from ..wire.vocab import BusState, ControlOp

__all__ = [
    "ALREADY",
    "CACHES_CLEARED",
    "IN_PROGRESS",
    "OP_OF_STATE",
    "ON_FAILURE",
    "ON_SUCCESS",
    "ROLLED_BACK",
    "RUNNING_OR_RESUMING",
    "STABLE",
    "BusState",
    "ControlOp",
    "on_failure",
    "stable",
]


# A client's op: the state it puts the bus in while every live rank acks it.
IN_PROGRESS: dict[ControlOp, BusState] = {
    ControlOp.PAUSE: BusState.PAUSING,
    ControlOp.CLEAR: BusState.CLEARING,
    ControlOp.RESUME: BusState.RESUMING,
}

# The state an op leaves when every live rank acked it.
ON_SUCCESS: dict[ControlOp, BusState] = {
    ControlOp.PAUSE: BusState.PAUSED,
    ControlOp.CLEAR: BusState.CLEARED,
    ControlOp.RESUME: BusState.RUNNING,
}

# A failed op (deadline, dead rank, failed allocation), by the state the bus
# was in before it began: the state it goes back to, and the op then
# published at a new epoch so that no rank stays half-way.  A failed pause
# runs again; a failed clear stays cleared (the generation moved on, laggards
# get repeats); a failed resume goes back where it came from, and one the
# broker started itself on a running bus stays "resuming" (paused) until its
# retry converges.  The first entry of each row is the rule for any other start.
ON_FAILURE: dict[ControlOp, dict[BusState, tuple[BusState, ControlOp]]] = {
    ControlOp.PAUSE: {
        BusState.RUNNING: (BusState.RUNNING, ControlOp.RESUME),
        BusState.RESUMING: (BusState.RESUMING, ControlOp.PAUSE),  # it took over from the broker's own resume
    },
    ControlOp.CLEAR: {BusState.PAUSED: (BusState.CLEARED, ControlOp.CLEAR)},
    ControlOp.RESUME: {
        BusState.RUNNING: (BusState.RESUMING, ControlOp.PAUSE),
        BusState.CLEARED: (BusState.CLEARED, ControlOp.CLEAR),
        BusState.PAUSED: (BusState.PAUSED, ControlOp.PAUSE),
    },
}

# How a failed resume's reason ends (docs/protocol.md §8.3), by the state it went back to.
ROLLED_BACK: dict[BusState, str] = {
    BusState.CLEARED: "the bus is cleared again",
    BusState.PAUSED: "the bus is paused again",
    BusState.RESUMING: "the broker retries the resume; the bus is paused again",
}

# A request for an op the bus has already reached: answered ``noop`` at once.
ALREADY: dict[ControlOp, frozenset[BusState]] = {
    ControlOp.PAUSE: frozenset({BusState.PAUSED, BusState.CLEARED}),
    ControlOp.CLEAR: frozenset({BusState.CLEARED}),
    ControlOp.RESUME: frozenset({BusState.RUNNING}),
}

# What a restarted broker resumes as, for each state it may have died in: an
# operation that had not completed did not happen, and "not running" is the
# safe side (a pause that was under way is completed by the ranks' acks).
# RESUMING is absent: it resumes as the state the resume began from.
STABLE: dict[BusState, BusState] = {
    BusState.RUNNING: BusState.RUNNING,
    BusState.PAUSING: BusState.PAUSED,
    BusState.PAUSED: BusState.PAUSED,
    BusState.CLEARING: BusState.CLEARED,
    BusState.CLEARED: BusState.CLEARED,
}

# The op a restored broker publishes for a stable state.
OP_OF_STATE: dict[BusState, ControlOp] = {
    BusState.RUNNING: ControlOp.RUN,
    BusState.PAUSED: ControlOp.PAUSE,
    BusState.CLEARED: ControlOp.CLEAR,
}

# States in which caches are gone: a submit is rejected, a joining rank frees.
CACHES_CLEARED = frozenset({BusState.CLEARING, BusState.CLEARED})

# States in which the bus holds its caches and may be running or about to:
# a rank that must allocate does so in a resume the broker starts itself.
RUNNING_OR_RESUMING = frozenset({BusState.RUNNING, BusState.RESUMING})


def stable(state: BusState, resume_began_from: BusState | None) -> BusState:
    """The state a broker restarted now resumes as (``resume_began_from``: the
    state a resume in progress began from, if one is)."""
    if state in STABLE:
        return STABLE[state]
    return STABLE.get(resume_began_from or BusState.RUNNING, BusState.RUNNING)


def on_failure(op: ControlOp, began_from: BusState) -> tuple[BusState, ControlOp]:
    """The state and published op after ``op``, begun from ``began_from``, failed."""
    by_start = ON_FAILURE[op]
    return by_start.get(began_from) or next(iter(by_start.values()))
