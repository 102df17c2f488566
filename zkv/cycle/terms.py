"""The words of an RL cycle (docs/engine-vllm.md, "The RL cycle"): its steps,
the phases its label records on an engine, how it ends, and what each engine
serves afterwards.  Each is a ``str`` enum, so a report's JSON carries the
plain words while the code compares members, never strings it parsed."""

from __future__ import annotations

import enum


class _Term(str, enum.Enum):
    """``str()`` and ``format()`` are the value itself (as ``enum.StrEnum`` on 3.11+)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Step(_Term):
    """One step of the cycle on one engine (the table of ``table.py`` orders them)."""

    SURVEY = "survey"  # read the engine's label: another cycle in progress? this one to finish?
    STAGE = "stage"  # the new checkpoint checked where it will be loaded, before anything pauses
    CLAIM = "claim"  # the cycle's record on the engine's label
    PAUSE = "pause"  # the engine stops scheduling (``/pause``)
    SLEEP = "sleep"  # or sleeps (``/sleep?level=0``)
    PAUSE_BUS = "pause_buses"  # the engine's bus acks once no copy is in flight
    CLEAR_BUS = "clear_buses"  # before the update, keeping the CPU tier (zkv owns the memory it frees)
    CHECKSUM_BEFORE = "checksum_before"  # the weights measured (the caller said they do not change)
    UPDATE = "update"  # the new weights loaded
    CHECKSUM_AFTER = "checksum_after"
    COMMIT = "commit"  # the fleet's decision recorded on the engine's label: from here, only forward
    DROP_TIERS = "drop_tiers"  # the bus cleared without its CPU tier: nothing of the old weights is served
    KEEP_TIERS = "keep_tiers"  # the bus cleared keeping its CPU tier: the weights were measured unchanged
    RESUME_BUS = "resume_buses"
    RESET = "reset_prefix_cache"  # the engine's prefix cache (and zkv's keys unless kept)
    RESUME = "resume"
    WAKE_UP = "wake_up"
    LABEL = "label"  # the engine's label after the cycle (the new one, or the old one after a rollback)
    ROLLBACK_WEIGHTS = "rollback_weights"
    LOOK = "look"  # what the engine answers at the end (``/health``, ``/is_paused``): the report's state


class Phase(_Term):
    """What an engine's cycle record says of the cycle (``label.py``), read back by a
    driver that runs the same cycle again."""

    CLAIMED = "claimed"  # the engine is in the cycle; its weights are the old ones
    UPDATING = "updating"  # its update was started: its weights may be the new ones
    COMMITTED = "committed"  # every engine was updated: the cycle only goes forward from here


class Outcome(_Term):
    """How a cycle ended (``zkv cycle``'s exit status: ``EXIT``)."""

    COMMITTED = "committed"  # every engine serves the new weights, resumed
    ROLLED_BACK = "rolled_back"  # every engine serves the old weights, its tiers intact, resumed
    INCOMPLETE = "incomplete"  # something is left: the report says what, and the command that finishes it
    REFUSED = "refused"  # nothing was touched (an engine did not answer, or a checkpoint did not check)


#: ``zkv cycle``'s exit status per outcome; 4: another cycle holds the fleet (``CycleBusy``).
#: Click's own usage errors exit 2 as well, with no report on stdout.
EXIT = {Outcome.COMMITTED: 0, Outcome.ROLLED_BACK: 1, Outcome.INCOMPLETE: 2, Outcome.REFUSED: 3}
EXIT_BUSY = 4


class Serves(_Term):
    """Which weights an engine serves after the cycle (or would, once it answers)."""

    NEW = "new"
    OLD = "old"
    UNKNOWN = "unknown"  # its update may have run and nothing loaded the old weights back


class State(_Term):
    """What the engine itself answered when the cycle last asked (``/health``, ``/is_paused``)."""

    SERVING = "serving"
    PAUSED = "paused"  # it answers, and it is paused or asleep
    DOWN = "down"  # nothing listens
    HUNG = "hung"  # it did not answer in time
    ERROR = "error"  # it answered, with an error


class Tiers(_Term):
    """What the cycle did to an engine's zkv tiers."""

    DROPPED = "dropped"  # the CPU generation moved: nothing of the old weights is served
    KEPT = "kept"  # the weights were measured unchanged: the tiers serve on
    INTACT = "intact"  # rolled back: the tiers as they were, under the old weights
    UNTOUCHED = "untouched"  # the cycle never reached its bus
    UNKNOWN = "unknown"  # a bus step did not answer


class PauseMode(_Term):
    """vLLM's pause (and sleep) modes: what happens to the requests in flight."""

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


class InFlight(_Term):
    """What became of an engine's requests in flight, by its pause mode (the policy a report declares)."""

    ABORTED = "aborted"  # abort: they ended at the pause, with vLLM's abort
    ANSWERED_OLD = "answered_on_old_weights"  # wait: they ran to their end before the pause answered
    RECOMPUTED = "continued_on_recomputed_kv"  # keep: frozen, then recomputed under the weights served after

    @classmethod
    def of(cls, mode: PauseMode) -> "InFlight":
        return {PauseMode.ABORT: cls.ABORTED, PauseMode.WAIT: cls.ANSWERED_OLD, PauseMode.KEEP: cls.RECOMPUTED}[mode]


class Reach(_Term):
    """How a step's failure left the engine, as far as it tells."""

    ANSWERED = "answered"  # it answered, with an error
    DOWN = "down"
    HUNG = "hung"
    BUS = "bus"  # its bus did not answer (the engine may still)
