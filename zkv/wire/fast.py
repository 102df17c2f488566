"""The typed decoder of a socket: one per socket, made once from the kinds
that socket receives (``sockets.py``), every kind on msgspec's typed path.

Rule 1: it accepts only what :func:`protocol.decode` accepts, and returns the
message that would (same class, fields, values and types).  msgspec decodes a
frame into the kind's message class (messages.py), checking types (a bool or
a float is not an int), ranges, enums and string lengths in C, refusing an
unknown field (msgspec would skip its value without the checks msgpack makes)
and reading a repeated key as msgpack does (the last one wins).  A frame it
refuses goes to ``protocol.decode(frame, kinds)``, so every refusal is that
codec's own ProtocolError, code and reason.  So does a frame not written as a
fixmap (more than 15 entries: msgpack bounds a map's entries, msgspec does
not), and a reply that carries its op's results (no type holds a field no
schema names).

It checks a frame against a *wire type* of its kind: the message class's
fields bounded as protocol.py's tables say, ``v`` required (msgspec has no
field that is required on the wire yet defaulted in Python) and ``kind``
required too: the tag of a tagged union when the socket takes two kinds or
more, a field of its one type when it takes one (msgspec reads a lone tagged
class without its tag).  A frame that passes is then made the message class
itself from the checked fields (the wire type's fields are the class's, in
its order: one C call each way, cheaper than a second parse), so a decoded
message is a ``Submit``, a ``Done``, ... and equals the same message made by
hand (msgspec's own equality).

Rule 2: nothing here restates the protocol.  Fields come from the message
classes, bounds and enums from protocol.py's tables.  Encoding needs no fast
path: every message class has its own ``to_wire()`` (messages.py).

The decoders keep no state between calls (and call no Python code): one may
serve several threads.
"""

from __future__ import annotations

import re
import typing
from typing import Any, Callable, Iterable

import msgspec
from msgspec.structs import astuple

from . import protocol as P
from .messages import MESSAGES, Reply

_MAP16 = 0xDE  # a msgpack map of n < 16 entries is the byte 0x80 + n, then its entries; 0xde starts a longer one
# typing's special forms, built from values at import (so the checker sees Any)
_Annotated: Any = typing.Annotated
_Literal: Any = typing.Literal
_Z85_KEY = r"\A[%s]{%d}\Z" % (
    "".join(re.escape(c) for c in sorted(P._Z85)),
    P.Z85_KEY_LEN,
)  # \Z: "$" passes a final "\n"


def _str(name: str) -> Any:
    if name == "reply_key":  # the check validate() makes of a reply_key wherever its schema names one
        return _Annotated[str, msgspec.Meta(max_length=P.MAX_STR, pattern=_Z85_KEY)]
    pattern = P.STR_PATTERN.get(name)
    if pattern is not None:
        return _Annotated[str, msgspec.Meta(max_length=P.STR_MAX[name], pattern=pattern)]
    return _Annotated[str, msgspec.Meta(max_length=P.STR_MAX.get(name, P.MAX_STR))]


def _nested(depth: int) -> Any:
    """What ``check_nested`` takes at ``depth`` inside a map / list field (the
    field itself is depth 0): a scalar, or a container whose entries sit one
    deeper; at ``MAX_NEST_DEPTH`` a container must be empty.  The entry count
    over the whole field is ``decoder``'s to check (no type bounds a sum).  No
    bin: msgspec takes one str-like type per union, so a map holding a bin
    goes to the slow path (ranks send none)."""
    text = _Annotated[str, msgspec.Meta(max_length=P.MAX_STR)]
    scalar: Any = typing.Union[
        _Annotated[int, msgspec.Meta(ge=-P.MAX_SAFE_INT, le=P.MAX_SAFE_INT)], float, text, bool, None
    ]
    if depth >= P.MAX_NEST_DEPTH:
        empty_list = _Annotated[list[Any], msgspec.Meta(max_length=0)]
        empty_map = _Annotated[dict[text, Any], msgspec.Meta(max_length=0)]  # type: ignore[valid-type]
        return typing.Union[scalar, empty_list, empty_map]
    inner = _nested(depth + 1)
    return typing.Union[scalar, list[inner], dict[text, inner]]  # type: ignore[valid-type]


_MAP_FIELD: Any = dict[_Annotated[str, msgspec.Meta(max_length=P.MAX_STR)], _nested(1)]  # type: ignore[misc]


_SOME_WORDS: dict[str, list[tuple[str, frozenset[str]]]] = {}  # kind -> (field, the words it may carry)


def _field_type(kind: str, name: str, typ: str) -> Any:
    """The msgspec type that accepts a subset of what ``_check_field`` does."""
    if typ == "uint":
        lo, hi = P.uint_bounds(kind, name)
        return _Annotated[int, msgspec.Meta(ge=lo, le=hi)]
    if typ == "str":
        allowed = P.ENUMS.get((kind, name))
        word = P.WORDS[kind].get(name)
        if word is not None:  # msgspec decodes its member, as protocol.message makes it
            if allowed is None or not set(allowed) <= {w.value for w in word}:
                raise TypeError(f"{kind}.{name}: its enum {word.__name__} is not protocol.ENUMS' words")
            if len(allowed) < len(word):  # some of the enum's words only: decoder checks the value
                _SOME_WORDS.setdefault(kind, []).append((name, frozenset(allowed)))
            return word
        return _str(name) if allowed is None else _Literal[allowed]
    if typ == "bool":
        return bool
    if typ == "bin":
        return bytes
    if typ == "ids":  # int32 range, MAX_IDS and whole int32s are task_body's to check, as for the slow path
        return bytes | list[int]
    if typ == "map":
        return P.LAYOUT_TYPES[kind] if name == "layout" else _MAP_FIELD  # a layout: its own checks
    if (typ, name) == ("list", "upto"):
        uint = _Annotated[int, msgspec.Meta(ge=0, le=P.MAX_SAFE_INT)]
        return _Annotated[list[uint], msgspec.Meta(max_length=P.LIST_MAX["upto"])]  # type: ignore[valid-type]
    if (typ, name) == ("list", "kept_tiers"):
        tier = _Annotated[str, msgspec.Meta(min_length=1, max_length=P.MAX_TIER_NAME)]
        return _Annotated[list[tier], msgspec.Meta(max_length=P.LIST_MAX["kept_tiers"])]  # type: ignore[valid-type]
    if (typ, name) == ("list", "digests"):
        digest = _Annotated[bytes, msgspec.Meta(min_length=P.DIGEST_BYTES, max_length=P.DIGEST_BYTES)]
        return _Annotated[list[digest], msgspec.Meta(max_length=P.LIST_MAX["digests"])]  # type: ignore[valid-type]
    raise TypeError(f"the fast codec has no type for {kind}.{name} ({typ}): add one from protocol.py's tables")


def wire_type(kind: str, tagged: bool = True) -> type[msgspec.Struct]:
    """What a ``kind`` frame must be: the message class's fields bounded as the tables
    say, ``v`` required, ``kind`` the tag (``tagged``, for a union) or a required
    field of its own; optional fields stay nil-able (``validate`` and the call
    sites take a nil as absent).  Only checked against, never returned."""
    required, optional = P.SCHEMAS[kind]
    fields: list[Any] = [(n, _field_type(kind, n, t)) for n, t in required.items()]
    fields += [(n, typing.Optional[_field_type(kind, n, t)], None) for n, t in optional.items()]
    fields.append(("v", _Literal[P.VERSION]))
    tag: dict[str, Any] = {"tag_field": "kind", "tag": kind}
    if not tagged:
        fields.append(("kind", _Literal[kind]))
        tag = {}
    wire: Any = msgspec.defstruct(
        f"{MESSAGES[kind].__name__}Wire",
        fields,
        module=__name__,
        kw_only=True,
        frozen=True,
        forbid_unknown_fields=True,
        **tag,
    )
    return wire


def _reply(req: int, op: str, *trailer: Any) -> Reply:
    """A reply with no field beside ``req`` and ``op``: its ``extra`` is empty
    (one with its op's results goes to the slow path, which keeps them)."""
    return Reply(req=req, op=op)


#: kind -> what makes the message of a checked frame from its fields, in order:
#: the class itself (the wire type's fields are its own, ``kind`` last or left
#: to its default), or, for a reply, whose ``extra`` is no wire field, ``_reply``
_MAKE: dict[str, Callable[..., Any]] = {kind: cls for kind, cls in MESSAGES.items() if kind != "reply"}
_MAKE["reply"] = _reply
#: kind -> its wire type as one of a union (``kind`` its tag)
TYPES: dict[str, type[msgspec.Struct]] = {kind: wire_type(kind) for kind in MESSAGES}
for _kind, _cls in MESSAGES.items():  # a checked frame's fields, in order, are its message's
    _own = tuple(n for n in _cls.__struct_fields__ if n != "extra")
    assert TYPES[_kind].__struct_fields__ == _own[:-1], _kind
_MAP_FIELDS = {  # the untyped map fields (a layout is typed: its struct checks it)
    kind: tuple(n for n, t in {**P.SCHEMAS[kind][0], **P.SCHEMAS[kind][1]}.items() if t == "map" and n != "layout")
    for kind in MESSAGES
}


def _entries(value: Any) -> int:
    """Entries of a map / list field, nested ones counted (``check_nested``'s budget).
    Recursive: the typed decoder already bounded the depth (``_nested``)."""
    total = len(value)
    for x in value.values() if type(value) is dict else value:
        t = type(x)
        if t is dict or t is list:
            total += _entries(x)
    return total


def _maps_fit(msg: Any, names: tuple[str, ...], frame_bytes: int) -> bool:
    """The bounds of a map field no type states: its entry count, and a
    ``stats`` map's encoded size, which its frame's bounds when half of
    ``MAX_STATS_BYTES`` (re-encoding at most grows a float32 from 5 bytes to 9).
    False: the slow path decides and names what is wrong."""
    for name in names:
        value = getattr(msg, name)
        if value is None:
            continue
        if _entries(value) > P.MAX_NEST_ITEMS or (name == "stats" and 2 * frame_bytes > P.MAX_STATS_BYTES):
            return False
    return True


Slow = Callable[[bytes, "tuple[str, ...] | None"], Any]


def _post_checks(kind: str) -> Callable[[Any, int], bool] | None:
    """The checks no msgspec type makes, for ``kind``: a map field's entry count
    and size, a field that carries some of its enum's words only."""
    maps, words = _MAP_FIELDS[kind], tuple(_SOME_WORDS.get(kind, ()))
    if not maps and not words:
        return None
    return lambda msg, size: _maps_fit(msg, maps, size) and all(getattr(msg, n) in ok for n, ok in words)


_CHECKS = {kind: _post_checks(kind) for kind in MESSAGES}


class Decode(typing.Protocol):
    """A socket's decoder: ``protocol.decode(frame, kinds)``, where ``kinds``
    are the socket's, or ``only`` (some of them) for a frame of a message
    that narrows them (``sockets.py``)."""

    def __call__(self, frame: bytes, only: tuple[str, ...] | None = None) -> Any: ...


def decoder(kinds: Iterable[str], slow: Slow = P.decode) -> Decode:
    """The one decoder of a socket that receives ``kinds`` (``sockets.py``), made
    once: msgspec's typed decoder of them first (a tagged union of two kinds or
    more, the one wire type of one kind), then ``slow`` (``protocol.decode``)
    for what it does not take (a test passes one that counts)."""
    if isinstance(kinds, str):
        raise TypeError(f"a socket's kinds are a tuple, not the str {kinds!r}")
    kinds = tuple(kinds)
    if not kinds or any(kind not in MESSAGES for kind in kinds) or len(set(kinds)) < len(kinds):
        raise ValueError(f"{kinds!r} is not a set of message kinds")
    types = [TYPES[kind] for kind in kinds] if len(kinds) > 1 else [wire_type(kinds[0], tagged=False)]
    typed = msgspec.msgpack.Decoder(typing.Union[tuple(types)] if len(types) > 1 else types[0]).decode
    cap = P.MAX_FRAME_BYTES
    # by wire type (a tag is no attribute): its kind, what makes its message, its checks no type makes
    table = {t: (kind, _MAKE[kind], _CHECKS[kind]) for t, kind in zip(types, kinds)}

    def decode(frame: bytes, only: tuple[str, ...] | None = None) -> Any:
        if len(frame) <= cap:
            try:
                wire = typed(frame)
            except Exception:  # noqa: BLE001 - any refusal: the slow path names it
                pass
            else:
                kind, make, check = table[type(wire)]
                if frame[0] < _MAP16 and (check is None or check(wire, len(frame))) and (only is None or kind in only):
                    return make(*astuple(wire))
        return slow(frame, kinds if only is None else only)

    decode.__doc__ = f"protocol.decode(frame, {kinds}) on the typed path, or with only some of them"
    return decode


_body = decoder(("body",))


def decode_body(frame: bytes) -> P.TaskBody:
    """:func:`protocol.decode_body`, the body read on the typed path."""
    return P.task_body(_body(frame))
