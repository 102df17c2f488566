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

Every class ends with ``v`` and ``kind``, filled in by the constructor (every
frame is version ``VERSION``, and ``kind`` is its class's): msgspec's own
encoder then writes a message as the frame's map, its set fields in order,
``v`` and ``kind`` last (``to_wire``, the bytes of docs/protocol.md's golden
vectors), and a decoder returns the class itself, so a decoded message equals
the one made by hand.  A ``reply`` carries the results of its op beside
``req`` and ``op``: they are in ``extra``, written among its fields.

    ack = Ack(epoch=3, op="pause", upto=7)
    protocol.decode_as(Ack, ack.to_wire()) == ack
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from .bounds import MAX_SAFE_INT, UINT_MAX, UINT_MIN
from .layout import CacheLayout, LayoutChange
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
#: a clear's name for the weights the engines serve after it (a trainer's version, a cycle's label):
#: 1-256 characters, none of them a control character
WeightsName = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]

_encode = msgspec.msgpack.Encoder().encode


def _version() -> int:
    return VERSION


#: every class's ``v``: the constructor fills it in, the encoder always writes it
_V: Any = msgspec.field(default_factory=_version)


def _kind(kind: str) -> Any:
    """A class's ``kind`` field: its word, filled in by the constructor and always written."""
    return msgspec.field(default_factory=lambda: kind)


def _plain(value: Any) -> Any:
    """A field's value as the frame's map has it: a layout as its map."""
    if isinstance(value, CacheLayout):
        return value.to_wire()
    if isinstance(value, LayoutChange):
        return value.named()
    return value


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The base of every message: read its fields as attributes (an absent
    optional is ``None``); ``as_map()`` is the map of its frame.  Frozen:
    nothing mutates a message once decoded.  Equality is msgspec's: same
    class, same fields."""

    def to_dict(self) -> dict[str, Any]:
        """The wire fields in schema order, ``None`` ones left out (and a
        reply's ``extra`` after them): what ``protocol.encode`` takes."""
        out = {name: getattr(self, name) for name in wire_fields(type(self))}
        out = {k: _plain(v) for k, v in out.items() if v is not None}
        out.update(getattr(self, "extra", None) or {})
        return out

    def as_map(self) -> dict[str, Any]:
        """The map of the frame: ``to_dict()``, then ``v`` and ``kind``."""
        return {**self.to_dict(), "v": VERSION, "kind": kind_of(type(self))}

    def to_wire(self) -> bytes:
        """The frame of this message: the bytes ``protocol.encode(kind, **self.to_dict())``
        writes, by msgspec's encoder (set fields in order, ``v`` and ``kind`` last)."""
        return _encode(self)


# --- client -> broker (frontend) -------------------------------------------------------


class Submit(Message, frozen=True):
    """The header of a task; its body follows as a second frame."""

    task: Uint
    reply_to: str
    timeout_ms: TimeoutMs | None = None
    reply_key: str | None = None
    batch_results: bool | None = None  # the client reads several results in one message (docs/protocol.md §10.3)
    v: int = _V
    kind: Literal["submit"] = _kind("submit")


class Pause(Message, frozen=True):
    req: Uint
    timeout_ms: TimeoutMs | None = None
    v: int = _V
    kind: Literal["pause"] = _kind("pause")


class Clear(Message, frozen=True):
    req: Uint
    timeout_ms: TimeoutMs | None = None
    keep_cpu: bool | None = None
    weights: WeightsName | None = None  # the weights served after this clear (one without keep_cpu)
    v: int = _V
    kind: Literal["clear"] = _kind("clear")


class Resume(Message, frozen=True):
    req: Uint
    timeout_ms: TimeoutMs | None = None
    layout: LayoutChange | None = None  # what changes of the bus's layout
    v: int = _V
    kind: Literal["resume"] = _kind("resume")


class Status(Message, frozen=True):
    req: Uint
    wait_ranks: WaitRanks | None = None
    timeout_ms: TimeoutMs | None = None
    v: int = _V
    kind: Literal["status"] = _kind("status")


class Ping(Message, frozen=True):
    req: Uint
    v: int = _V
    kind: Literal["ping"] = _kind("ping")


class Cancel(Message, frozen=True):
    """End a task of this connection that is still queued (docs/protocol.md §7.6)."""

    req: Uint
    task: Uint
    v: int = _V
    kind: Literal["cancel"] = _kind("cancel")


# --- broker -> client (frontend) -------------------------------------------------------


class Reply(Message, frozen=True):
    """A request's answer; ``extra`` holds the fields its op returns (not a wire field)."""

    req: Uint
    op: str
    extra: Map = msgspec.field(default_factory=dict)
    v: int = _V
    kind: Literal["reply"] = _kind("reply")

    def to_wire(self) -> bytes:
        """``req`` and ``op``, the results of its op beside them (``extra``), then ``v`` and ``kind``."""
        return _encode({"req": self.req, "op": self.op, **self.extra, "v": VERSION, "kind": "reply"})


class Error(Message, frozen=True):
    code: str
    reason: str
    req: Uint | None = None
    task: Uint | None = None
    v: int = _V
    kind: Literal["error"] = _kind("error")


class OutcomeMsg(Message, frozen=True):
    """How a task ended, from the broker."""

    task: Uint
    outcome: Outcome
    reason: str
    gen: Uint | None = None
    cpu_gen: Uint | None = None
    ran: bool | None = None  # false: never dispatched, no rank touched its blocks (§7.3)
    v: int = _V
    kind: Literal["outcome"] = _kind("outcome")


# --- rank -> broker (backend) ----------------------------------------------------------


class Ready(Message, frozen=True):
    rank: RankNo
    world: World
    session: Uint
    layout: CacheLayout
    gen: Uint
    pid: Pid | None = None
    fresh: bool | None = None
    has_cache: bool | None = None
    host: str | None = None
    kept_tiers: list[str] | None = None
    cpu_gen: Uint | None = None
    adopt_layout: bool | None = None
    v: int = _V
    kind: Literal["ready"] = _kind("ready")


class Heartbeat(Message, frozen=True):
    inflight: Uint | None = None
    stats: Map | None = None
    probe: bool | None = None
    v: int = _V
    kind: Literal["hb"] = _kind("hb")


class Done(Message, frozen=True):
    """A rank finished the task dispatched as ``seq``: ``outcome`` is ok or failed."""

    seq: Uint
    n: Uint
    outcome: RankOutcome
    gen: Uint
    bytes: ByteCount | None = None
    v: int = _V
    kind: Literal["done"] = _kind("done")


class Ack(Message, frozen=True):
    """A rank acknowledges the op of ``epoch`` (its fields in the order a rank writes them)."""

    epoch: Uint
    op: ControlOp  # pause, clear or resume (protocol.ENUMS)
    gen: Uint | None = None
    upto: Uint | None = None
    freed: Freed | None = None
    layout: CacheLayout | None = None
    cpu_kept: bool | None = None
    stats: Map | None = None
    error: str | None = None
    v: int = _V
    kind: Literal["ack"] = _kind("ack")


# --- broker -> rank (backend, and PUB) -------------------------------------------------


class Welcome(Message, frozen=True):
    epoch: Uint
    op: ControlOp
    gen: Uint
    upto: Uint
    layout: CacheLayout
    heartbeat_ms: HeartbeatMs
    keep_cpu: bool | None = None
    session: Uint | None = None
    v: int = _V
    kind: Literal["welcome"] = _kind("welcome")


class Refused(Message, frozen=True):
    reason: str
    v: int = _V
    kind: Literal["refused"] = _kind("refused")


class Reregister(Message, frozen=True):
    v: int = _V
    kind: Literal["reregister"] = _kind("reregister")


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
    v: int = _V
    kind: Literal["task"] = _kind("task")


class Control(Message, frozen=True):
    """The control state the broker repeats on PUB: ``upto[r]`` tasks went to rank ``r``."""

    epoch: Uint
    op: ControlOp  # pause, clear or resume (protocol.ENUMS)
    gen: Uint
    upto: list[Uint]
    keep_cpu: bool | None = None
    layout: CacheLayout | None = None
    v: int = _V
    kind: Literal["control"] = _kind("control")


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
    v: int = _V
    kind: Literal["result"] = _kind("result")


class Body(Message, frozen=True):
    """The second frame of ``submit`` and ``task``: ``protocol.task_body`` checks it."""

    op: str
    src: Ids | None = None
    dst: Ids | None = None
    tier: str | None = None
    seed: Uint | None = None
    keys: bytes | None = None  # a keyed move's names: each key a length byte, then its bytes (protocol.pack_keys)
    ns: str | None = None  # a keyed move's namespace
    v: int = _V
    kind: Literal["body"] = _kind("body")


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


def _kind_word(cls: type[Message]) -> str:
    """Its ``kind`` field's word (read once per class: ``msgspec.structs.fields`` evaluates annotations)."""
    return str(msgspec.structs.fields(cls)[-1].default_factory())


_KIND_OF: dict[type[Message], str] = {cls: _kind_word(cls) for cls in _CLASSES}


def kind_of(cls: type[Message]) -> str:
    """The ``kind`` a class's frames carry (its ``kind`` field's word)."""
    kind = _KIND_OF.get(cls)
    return kind if kind is not None else _kind_word(cls)


#: the fields every class ends with, in this order
_TRAILER = ("v", "kind")
for _cls in _CLASSES:
    assert _cls.__struct_fields__[-2:] == _TRAILER, f"{_cls.__name__} must end with v and kind"
MESSAGES: dict[str, type[Message]] = {kind: cls for cls, kind in _KIND_OF.items()}
_WIRE_FIELDS: dict[str, tuple[str, ...]] = {
    kind: tuple(n for n in cls.__struct_fields__ if n not in ("extra", *_TRAILER)) for kind, cls in MESSAGES.items()
}


def wire_fields(cls: type[Message]) -> tuple[str, ...]:
    """The fields of ``cls`` a frame carries, in order (a reply's ``extra``, ``v`` and ``kind`` are not)."""
    return _WIRE_FIELDS[kind_of(cls)]


__all__ = [
    "MESSAGES",
    "Message",
    "Ids",
    "Map",
    "kind_of",
    "wire_fields",
    *(cls.__name__ for cls in MESSAGES.values()),
]
