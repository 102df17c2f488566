"""The decisions of one fleet operation, sans-IO: what each bus's answer
means for the whole (all or nothing), which buses a failed pause resumes,
and when each bus is done.  The driver (``driver.py``) feeds it the answers
as they come and asks it, per bus, what to do next; ``report.py`` turns
the finished operation into what the caller reads.

The rules (docs/engines.md, "A fleet of engines"):

- an operation succeeds only when every bus answered ``ok`` or ``noop``;
- a failed **pause** resumes the buses it paused (``on_failure="resume"``),
  each as soon as its own pause ended, or leaves them paused
  (``on_failure="stay"``).  It resumes a bus that acked and one that did not
  answer in time (its pause may have completed; a resume of a running bus
  is a noop).  It leaves alone a bus that was already paused or cleared
  (``noop``: that is where it was), one whose pause the broker failed (the
  broker runs it again, docs/protocol.md §8.3), and one it never reached;
- clear and resume roll nothing back (freed memory cannot come back); a
  retry of the same call repairs the fleet, because a bus already there
  answers ``noop``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from ..wire.replies import ControlReply, StatusReply
from ..wire.vocab import BusState, ControlOp

OPS = (ControlOp.PAUSE, ControlOp.CLEAR, ControlOp.RESUME, "status")
ON_FAILURE = (ControlOp.RESUME, "stay")


class Answer(str, Enum):
    """What one bus answered one request."""

    OK = "ok"  # the broker did it
    NOOP = "noop"  # the bus already was there
    ERROR = "error"  # the broker refused or failed it (``code``)
    NO_REPLY = "no_reply"  # nothing came before the deadline: what the bus did is unknown
    UNREACHABLE = "unreachable"  # nothing was sent: no broker listens there, or the client could not be made

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class BusAnswer:
    """One bus's answer: ``at_ms`` since the fleet operation began, the
    broker's error ``code`` and ``reason``, and its reply (None unless ok or noop)."""

    answer: Answer
    at_ms: float
    code: str = ""
    reason: str = ""
    reply: ControlReply | StatusReply | None = None

    @property
    def ok(self) -> bool:
        return self.answer in (Answer.OK, Answer.NOOP)

    @property
    def label(self) -> str:
        """``ok``, ``noop``, the error code, ``no_reply`` or ``unreachable``."""
        return self.code if self.answer is Answer.ERROR else str(self.answer)


class Step(str, Enum):
    WAIT = "wait"  # the fleet's outcome is not known yet
    ROLLBACK = "rollback"  # resume this bus: the fleet pause failed
    DONE = "done"


#: Errors after which the broker says where the bus is (docs/protocol.md §8.3).
_STATE_AFTER_ERROR: dict[str, dict[str, BusState]] = {
    ControlOp.PAUSE: {"pause_timeout": BusState.RUNNING, "rank_dead": BusState.RUNNING},
    ControlOp.CLEAR: {"clear_timeout": BusState.CLEARED, "rank_dead": BusState.CLEARED},
}
#: How a failed resume's reason ends, by the state it rolled back to (docs/protocol.md §8.3).
_RESUME_ROLLED_BACK = (("the bus is cleared again", BusState.CLEARED), ("the bus is paused again", BusState.PAUSED))


class FleetOp:
    """One operation over named buses: answers in, next steps and the outcome out."""

    def __init__(self, op: str, names: Sequence[str], on_failure: str = ControlOp.RESUME):
        if op not in OPS:
            raise ValueError(f"unknown fleet operation {op!r} (known: {', '.join(OPS)})")
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure {on_failure!r}: one of {', '.join(ON_FAILURE)}")
        if len(set(names)) != len(names) or not names:
            raise ValueError("a fleet operation needs one or more distinct bus names")
        self.op = op
        self.names = tuple(names)
        self.on_failure = on_failure
        self.answers: dict[str, BusAnswer] = {}
        self.rollbacks: dict[str, BusAnswer] = {}

    # --- in ---------------------------------------------------------------------------

    def answered(self, name: str, answer: BusAnswer) -> None:
        self._known(name)
        if name in self.answers:
            raise ValueError(f"bus {name} already answered {self.op}")
        self.answers[name] = answer

    def rolled_back(self, name: str, answer: BusAnswer) -> None:
        if self.step(name) is not Step.ROLLBACK:
            raise ValueError(f"bus {name} has no rollback to report")
        self.rollbacks[name] = answer

    # --- out --------------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """Some bus answered other than ok / noop (the fleet operation failed)."""
        return any(not a.ok for a in self.answers.values())

    @property
    def all_answered(self) -> bool:
        return len(self.answers) == len(self.names)

    @property
    def ok(self) -> bool:
        return self.all_answered and not self.failed

    def needs_rollback(self, name: str) -> bool:
        """A bus this failed pause may have paused, to be resumed."""
        answer = self.answers.get(name)
        return (
            self.op == ControlOp.PAUSE
            and self.on_failure == ControlOp.RESUME
            and answer is not None
            and answer.answer in (Answer.OK, Answer.NO_REPLY)
        )

    def step(self, name: str) -> Step:
        """What the driver does next for bus ``name``."""
        self._known(name)
        if name not in self.answers:
            return Step.WAIT
        if name in self.rollbacks or not self.needs_rollback(name):
            return Step.DONE
        if self.failed:
            return Step.ROLLBACK
        return Step.DONE if self.all_answered else Step.WAIT

    @property
    def settled(self) -> bool:
        return all(self.step(n) is Step.DONE for n in self.names)

    def state_after(self, name: str) -> str | None:
        """The bus's state after the operation as its answers tell it, None when unknown."""
        answer = self.answers.get(name)
        if answer is None:
            return None
        back = self.rollbacks.get(name)
        if back is not None:
            return BusState.RUNNING if back.ok else None
        if self.needs_rollback(name) and self.failed:
            return None  # it had to be resumed and was not (yet)
        if answer.ok:
            return answer.reply.state if answer.reply is not None else None
        if answer.answer is Answer.ERROR:
            if self.op == ControlOp.RESUME:
                return next((s for end, s in _RESUME_ROLLED_BACK if answer.reason.endswith(end)), None)
            return _STATE_AFTER_ERROR.get(self.op, {}).get(answer.code)
        return None

    def _known(self, name: str) -> None:
        if name not in self.names:
            raise KeyError(f"no bus {name!r} in this fleet operation")
