"""One frozen dataclass per message kind, built from ``protocol.SCHEMAS`` (so
the schema table stays the one definition of every message's fields).

``Kind.from_wire(frame)`` decodes and validates a frame (``ProtocolError`` on
bad input) and returns the typed message; ``msg.to_wire()`` encodes it.
Required fields are required arguments; optional ones default to ``None`` and
are left out of the frame when ``None``.  Fields a kind's schema does not name
(a ``reply`` carries the op's own results) travel in ``extra``.

    ack = Ack(epoch=3, op="pause", upto=7)
    Ack.from_wire(ack.to_wire()) == ack
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from . import protocol as P

_PY_TYPES = {"uint": int, "str": str, "bool": bool, "map": dict, "list": list, "ids": Any, "bin": bytes}


class Message:
    """The base of every typed message: ``KIND`` names its ``kind`` on the wire."""

    KIND: ClassVar[str] = ""
    extra: dict[str, Any]

    if TYPE_CHECKING:  # the fields come from the schema table at import time
        def __init__(self, **fields: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

    @classmethod
    def from_wire(cls, frame: bytes) -> "Message":
        """Decode and validate ``frame`` as this kind; raise ProtocolError otherwise."""
        return cls.from_dict(P.decode(frame, (cls.KIND,)))

    @classmethod
    def from_dict(cls, msg: dict[str, Any]) -> "Message":
        """A message already decoded and validated (``protocol.decode``)."""
        required, optional = P.SCHEMAS[cls.KIND]
        named = {k: msg[k] for k in (*required, *optional) if k in msg}
        extra = {k: v for k, v in msg.items() if k not in named and k not in ("v", "kind")}
        return cls(**named, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The fields as ``protocol.encode`` takes them (``None`` optionals left out)."""
        required, optional = P.SCHEMAS[self.KIND]
        out = {k: getattr(self, k) for k in required}
        out.update({k: getattr(self, k) for k in optional if getattr(self, k) is not None})
        out.update(self.extra)
        return out

    def to_wire(self) -> bytes:
        return P.encode(self.KIND, **self.to_dict())


def _class_name(kind: str) -> str:
    return {"hb": "Heartbeat"}.get(kind, kind.title().replace("_", ""))


def _make(kind: str) -> type[Message]:
    required, optional = P.SCHEMAS[kind]
    fields: list[Any] = [(name, _PY_TYPES[typ]) for name, typ in required.items()]
    fields += [(name, _PY_TYPES[typ] | None if _PY_TYPES[typ] is not Any else Any, dataclasses.field(default=None))
               for name, typ in optional.items()]
    fields.append(("extra", dict, dataclasses.field(default_factory=dict, compare=True)))
    cls = dataclasses.make_dataclass(_class_name(kind), fields, bases=(Message,), frozen=True, kw_only=True,
                                     namespace={"KIND": kind, "__module__": __name__,
                                                "__doc__": f"The ``{kind}`` message (fields from ``protocol.SCHEMAS``)."})
    return cls


#: kind -> its class, for every kind in the schema table.
MESSAGES: dict[str, type[Message]] = {kind: _make(kind) for kind in P.SCHEMAS}

Submit = MESSAGES["submit"]
Pause = MESSAGES["pause"]
Clear = MESSAGES["clear"]
Resume = MESSAGES["resume"]
Status = MESSAGES["status"]
Ping = MESSAGES["ping"]
Reply = MESSAGES["reply"]
Error = MESSAGES["error"]
Outcome = MESSAGES["outcome"]
Ready = MESSAGES["ready"]
Heartbeat = MESSAGES["hb"]
Done = MESSAGES["done"]
Ack = MESSAGES["ack"]
Welcome = MESSAGES["welcome"]
Refused = MESSAGES["refused"]
Reregister = MESSAGES["reregister"]
Task = MESSAGES["task"]
Control = MESSAGES["control"]
Result = MESSAGES["result"]
Body = MESSAGES["body"]


def from_wire(frame: bytes, expect_kinds: tuple[str, ...] | None = None) -> Message:
    """Decode any frame (of ``expect_kinds``, when given) as its typed message."""
    msg = P.decode(frame, expect_kinds)
    return MESSAGES[msg["kind"]].from_dict(msg)


__all__ = ["MESSAGES", "Message", "from_wire", *(cls.__name__ for cls in MESSAGES.values())]
