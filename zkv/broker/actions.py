"""What the broker core asks its loop to do: frames to send, a control
message to publish, a trace record, a durable snapshot to write.

Slotted, not frozen: several are made per task, and a frozen dataclass's
``__init__`` costs ~3 us, six times a plain one.  Treat them as
values all the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Union

from ..wire import protocol as P
from ..wire.messages import Error, OutcomeMsg
from ..wire.replies import Answer
from ..wire.vocab import Outcome


@dataclass(slots=True)
class ToClient:
    client: bytes
    frames: list[bytes]


@dataclass(slots=True)
class ToRank:
    identity: bytes
    frames: list[bytes]


@dataclass(frozen=True)
class Publish:
    frame: bytes


@dataclass(frozen=True)
class Record:
    event: dict[str, Any]


@dataclass(frozen=True)
class SaveState:
    """Write this snapshot to the broker's durable state file (``state_file.py``)."""

    snapshot: dict[str, Any]


Action = Union[ToClient, ToRank, Publish, Record, SaveState]


def frames_of(actions: Iterable[Action], kind: type) -> list[Any]:
    """Test helper: the actions of one type, in order."""
    return [a for a in actions if isinstance(a, kind)]


def answer_to(client: bytes, answer: Answer) -> ToClient:
    """A client request's answer, typed (``wire/replies.py``: the client reads it back as one)."""
    return ToClient(client, [answer.to_wire()])


def error(client: bytes, code: str, reason: str, **fields: Any) -> ToClient:
    """A client request refused or failed, with its code."""
    return ToClient(client, [Error(code=code, reason=P.clamp(reason), **fields).to_wire()])


def outcome(client: bytes, task: int, result: str, reason: str, gen: int, ran: bool | None = None) -> ToClient:
    """A task's final outcome, told by the broker itself (the ranks tell the
    rest); ``ran=False``: it was never dispatched."""
    return ToClient(
        client, [OutcomeMsg(task=task, outcome=Outcome(result), reason=P.clamp(reason), gen=gen, ran=ran).to_wire()]
    )
