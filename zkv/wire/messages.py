"""One typed message per kind: the fields every frame of that kind carries.

Each class is a frozen ``msgspec.Struct``: required fields are the schema's
required ones, optional ones default to ``None`` (absent and nil are the same
on the wire, docs/protocol.md §2).  The classes are the one definition of
each kind's fields: ``protocol.SCHEMAS`` is read off them, and
``protocol.py``'s tables add the bounds.  Every decoder (``protocol.decode``,
the fast path in ``fast.py``) returns these, and the only way zkv writes a
frame is to build one and call its ``to_wire()``.  Decoding (the checks of
every field) is ``protocol.py``'s; encoding, which checks nothing a
constructor did not, is here.

``kind`` is a class attribute (the ``kind`` the frame carries); ``v`` is not a
field, every frame is version ``VERSION``.  A ``reply`` carries the results of
its op beside ``req`` and ``op``: they are in ``extra``.

    ack = Ack(epoch=3, op="pause", upto=7)
    protocol.decode_as(Ack, ack.to_wire()) == ack
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Union

import msgspec

from .bounds import MAX_SAFE_INT, UINT_MAX, UINT_MIN
from .vocab import VERSION, ControlOp, Outcome, RankOutcome

Digest = bytes  # one checksum digest (a name: a field called ``bytes`` hides the type in a class body)
Ids = Union[bytes, list[int]]  # a block-id list: packed little-endian int32, or an array of int
Map = dict[str, Any]


# uint fields, bounded as bounds.py's tables bound their names (the same in
# every kind; a test holds each field's bounds to ``uint_bounds``): decoders
# check the bounds, constructors do not
Uint = Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]  # seq, n, task, req, gen, epoch, session, ...
World = Annotated[int, msgspec.Meta(ge=UINT_MIN["world"], le=UINT_MAX["world"])]
RankNo = Annotated[int, msgspec.Meta(ge=0, le=UINT_MAX["rank"])]
WaitRanks = Annotated[int, msgspec.Meta(ge=0, le=UINT_MAX["wait_ranks"])]
TimeoutMs = Annotated[int, msgspec.Meta(ge=0, le=UINT_MAX["timeout_ms"])]
HeartbeatMs = Annotated[int, msgspec.Meta(ge=UINT_MIN["heartbeat_ms"], le=UINT_MAX["heartbeat_ms"])]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=UINT_MAX["bytes"])]
Freed = Annotated[int, msgspec.Meta(ge=0, le=UINT_MAX["freed"])]
Pid = Annotated[int, msgspec.Meta(ge=0, le=UINT_MAX["pid"])]

_KIND_OF_CLASS = {"Heartbeat": "hb", "OutcomeMsg": "outcome"}


def _kind_of(class_name: str) -> str:
    return _KIND_OF_CLASS.get(class_name, class_name.lower())


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind", tag=_kind_of):
    """The base of every message: read its fields as attributes (an absent
    optional is ``None``); ``as_map()`` is the map of its frame.  Frozen:
    nothing mutates a message once decoded."""

    kind: ClassVar[str]
    v: ClassVar[int] = VERSION

    def to_dict(self) -> dict[str, Any]:
        """The wire fields in schema order, ``None`` ones left out (and a
        reply's ``extra`` after them): what ``protocol.encode`` takes."""
        out = {name: getattr(self, name) for name in _WIRE_FIELDS[self.kind]}
        out = {k: v for k, v in out.items() if v is not None}
        out.update(getattr(self, "extra", None) or {})
        return out

    def as_map(self) -> dict[str, Any]:
        """The map of the frame: ``to_dict()``, then ``v`` and ``kind``."""
        return {**self.to_dict(), "v": VERSION, "kind": self.kind}

    def to_wire(self) -> bytes:
        """The frame of this message: the bytes ``protocol.encode(kind,
        **self.to_dict())`` writes (each class gets its own, ``_wire_encoder``)."""
        raise NotImplementedError  # replaced on every message class below

    def __eq__(self, other: object) -> bool:
        """Same kind, same fields (a fast-path decode is a subclass, ``fast.py``)."""
        if not isinstance(other, Message):
            return NotImplemented
        names = MESSAGES[self.kind].__struct_fields__
        return self.kind == other.kind and all(getattr(self, n) == getattr(other, n) for n in names)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]  # mutable fields (maps, lists); as a dict was


# --- client -> broker (frontend) -------------------------------------------------------


class Submit(Message, frozen=True):
    """The header of a task; its body follows as a second frame."""

    task: Uint
    reply_to: str
    timeout_ms: TimeoutMs | None = None
    reply_key: str | None = None
    batch_results: bool | None = None  # the client reads several results in one message (docs/protocol.md §10.3)


class Pause(Message, frozen=True):
    req: Uint
    timeout_ms: TimeoutMs | None = None


class Clear(Message, frozen=True):
    req: Uint
    timeout_ms: TimeoutMs | None = None
    keep_cpu: bool | None = None


class Resume(Message, frozen=True):
    req: Uint
    timeout_ms: TimeoutMs | None = None
    layout: Map | None = None


class Status(Message, frozen=True):
    req: Uint
    wait_ranks: WaitRanks | None = None
    timeout_ms: TimeoutMs | None = None


class Ping(Message, frozen=True):
    req: Uint


class Cancel(Message, frozen=True):
    """End a task of this connection that is still queued (docs/protocol.md §7.6)."""

    req: Uint
    task: Uint


# --- broker -> client (frontend) -------------------------------------------------------


class Reply(Message, frozen=True):
    """A request's answer; ``extra`` holds the fields its op returns (not a wire field)."""

    req: Uint
    op: str
    extra: Map = msgspec.field(default_factory=dict)


class Error(Message, frozen=True):
    code: str
    reason: str
    req: Uint | None = None
    task: Uint | None = None


class OutcomeMsg(Message, frozen=True):
    """How a task ended, from the broker."""

    task: Uint
    outcome: Outcome
    reason: str
    gen: Uint | None = None
    cpu_gen: Uint | None = None
    ran: bool | None = None  # false: never dispatched, no rank touched its blocks (§7.3)


# --- rank -> broker (backend) ----------------------------------------------------------


class Ready(Message, frozen=True):
    rank: RankNo
    world: World
    session: Uint
    layout: Map
    gen: Uint
    pid: Pid | None = None
    fresh: bool | None = None
    has_cache: bool | None = None
    host: str | None = None
    kept_tiers: list[str] | None = None
    cpu_gen: Uint | None = None
    adopt_layout: bool | None = None


class Heartbeat(Message, frozen=True):
    inflight: Uint | None = None
    stats: Map | None = None
    probe: bool | None = None


class Done(Message, frozen=True):
    """A rank finished the task dispatched as ``seq``: ``outcome`` is ok or failed."""

    seq: Uint
    n: Uint
    outcome: RankOutcome
    gen: Uint
    bytes: ByteCount | None = None


class Ack(Message, frozen=True):
    """A rank acknowledges the op of ``epoch`` (its fields in the order a rank writes them)."""

    epoch: Uint
    op: ControlOp  # pause, clear or resume (protocol.ENUMS)
    gen: Uint | None = None
    upto: Uint | None = None
    freed: Freed | None = None
    layout: Map | None = None
    cpu_kept: bool | None = None
    stats: Map | None = None
    error: str | None = None


# --- broker -> rank (backend, and PUB) -------------------------------------------------


class Welcome(Message, frozen=True):
    epoch: Uint
    op: ControlOp
    gen: Uint
    upto: Uint
    layout: Map
    heartbeat_ms: HeartbeatMs
    keep_cpu: bool | None = None
    session: Uint | None = None


class Refused(Message, frozen=True):
    reason: str


class Reregister(Message, frozen=True):
    pass


class Task(Message, frozen=True):
    """The header of a task sent to one rank; its body follows untouched."""

    seq: Uint
    n: Uint
    task: Uint
    reply_to: str
    gen: Uint
    reply_key: str | None = None
    session: Uint | None = None
    cpu_gen: Uint | None = None
    batch_results: bool | None = None  # copied from the submit


class Control(Message, frozen=True):
    """The control state the broker repeats on PUB: ``upto[r]`` tasks went to rank ``r``."""

    epoch: Uint
    op: ControlOp  # pause, clear or resume (protocol.ENUMS)
    gen: Uint
    upto: list[Uint]
    keep_cpu: bool | None = None
    layout: Map | None = None


# --- rank -> client (PUSH), and the task body ------------------------------------------


class Result(Message, frozen=True):
    task: Uint
    rank: RankNo
    world: World
    outcome: RankOutcome
    reason: str
    gen: Uint
    bytes: ByteCount | None = None
    elapsed_us: Uint | None = None
    digests: list[Digest] | None = None
    cpu_gen: Uint | None = None


class Body(Message, frozen=True):
    """The second frame of ``submit`` and ``task``: ``protocol.task_body`` checks it."""

    op: str
    src: Ids | None = None
    dst: Ids | None = None
    tier: str | None = None
    seed: Uint | None = None


#: kind -> its class, in the order of docs/protocol.md §4.
_CLASSES: tuple[type[Message], ...] = (
    Submit,
    Pause,
    Clear,
    Resume,
    Status,
    Ping,
    Cancel,
    Reply,
    Error,
    OutcomeMsg,
    Ready,
    Heartbeat,
    Done,
    Ack,
    Welcome,
    Refused,
    Reregister,
    Task,
    Control,
    Result,
    Body,
)
for _cls in _CLASSES:
    _cls.kind = str(_cls.__struct_config__.tag)  # the tag msgspec checks, readable as ``msg.kind``
MESSAGES: dict[str, type[Message]] = {cls.kind: cls for cls in _CLASSES}
_WIRE_FIELDS: dict[str, tuple[str, ...]] = {
    kind: tuple(n for n in cls.__struct_fields__ if n != "extra") for kind, cls in MESSAGES.items()
}
_encode = msgspec.msgpack.Encoder().encode  # a map of these values: msgpack.packb's bytes, in a third of the time


def _wire_encoder(cls: type[Message]) -> Any:
    """``cls.to_wire``, written out for its fields: the required ones in one
    map literal, each optional one only when set, a reply's ``extra`` as it
    came, then ``v`` and ``kind`` (the bytes ``protocol.encode`` writes for the
    same fields, in schema order).  Generated, as ``dataclasses`` writes
    ``__init__``: a loop over the field names costs three times as much, and
    ``done`` and ``outcome`` are encoded once per task."""
    info = {f.name: f for f in msgspec.structs.fields(cls)}
    names = _WIRE_FIELDS[cls.kind]
    assert all(n.isidentifier() for n in names)
    required = ", ".join(f"{n!r}: self.{n}" for n in names if info[n].required)
    lines = ["def to_wire(self):", f"    out = {{{required}}}"]
    for n in names:
        if not info[n].required:
            lines += [f"    value = self.{n}", "    if value is not None:", f"        out[{n!r}] = value"]
    if "extra" in info:
        lines += ["    if self.extra:", "        out.update(self.extra)"]
    lines += [f"    out['v'] = {VERSION!r}", f"    out['kind'] = {cls.kind!r}", "    return _encode(out)"]
    namespace: dict[str, Any] = {"_encode": _encode}
    exec("\n".join(lines), namespace)  # noqa: S102 - source made above from the class's own field names
    to_wire = namespace["to_wire"]
    to_wire.__doc__ = Message.to_wire.__doc__
    to_wire.__qualname__ = f"{cls.__name__}.to_wire"
    return to_wire


for _cls in _CLASSES:
    _cls.to_wire = _wire_encoder(_cls)  # type: ignore[method-assign]


def wire_fields(cls: type[Message]) -> tuple[str, ...]:
    """The fields of ``cls`` a frame carries, in order (a reply's ``extra`` is not one)."""
    return _WIRE_FIELDS[cls.kind]


__all__ = [
    "MESSAGES",
    "Message",
    "Ids",
    "Map",
    "wire_fields",
    *(cls.__name__ for cls in MESSAGES.values()),
]
