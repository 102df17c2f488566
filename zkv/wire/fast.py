"""The typed fast path of the hot message kinds: ``submit``, ``task``,
``done``, ``result`` and the task ``body``, the frames every task sends, and
the pause's ``control`` and every rank's ``ack`` of it, and ``hb`` (an ack
and a heartbeat carry the rank's ``stats`` map).

Rule 1: it accepts only what :func:`protocol.decode` accepts, and returns the
message that would (same class, fields, values and types).  msgspec decodes a
frame into the kind's message class (messages.py), checking types (a bool or
a float is not an int), ranges, enums and string lengths in C, refusing an
unknown field (msgspec would skip its value without the checks msgpack makes)
and reading a repeated key as msgpack does (the last one wins).  A frame it
refuses goes to ``protocol.decode``, so every refusal is that codec's own
ProtocolError, code and reason.  So does a frame not written as a fixmap (more
than 15 entries: msgpack bounds a map's entries, msgspec does not).

It checks a frame against a *wire type* of its kind: the message class's
fields bounded as protocol.py's tables say, ``v`` required (msgspec has no
field that is required on the wire yet defaulted in Python) and ``kind`` the
tag that picks the type.  A frame that passes is then made the message class
itself from the checked fields (the wire type's fields are the class's, in
its order, ``kind`` aside: one C call each way, cheaper than a second parse),
so a decoded message is a ``Submit``, a ``Done``, ... and equals the same
message made by hand (msgspec's own equality).

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
from .messages import MESSAGES

HOT_KINDS = ("submit", "task", "done", "result", "body", "ack", "hb", "control")
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
    return _Annotated[str, msgspec.Meta(max_length=P.MAX_STR)]


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
    if (typ, name) == ("list", "digests"):
        digest = _Annotated[bytes, msgspec.Meta(min_length=P.DIGEST_BYTES, max_length=P.DIGEST_BYTES)]
        return _Annotated[list[digest], msgspec.Meta(max_length=P.LIST_MAX["digests"])]  # type: ignore[valid-type]
    raise TypeError(
        f"the fast codec has no type for {kind}.{name} ({typ}); add one or leave the kind to protocol.decode"
    )


def wire_type(kind: str) -> type[msgspec.Struct]:
    """What a ``kind`` frame must be: the message class's fields bounded as the tables
    say, ``v`` required, ``kind`` the tag; optional fields stay nil-able (``validate``
    and the call sites take a nil as absent).  Only checked against, never returned."""
    required, optional = P.SCHEMAS[kind]
    fields: list[Any] = [(n, _field_type(kind, n, t)) for n, t in required.items()]
    fields += [(n, typing.Optional[_field_type(kind, n, t)], None) for n, t in optional.items()]
    fields.append(("v", _Literal[P.VERSION]))
    wire: Any = msgspec.defstruct(
        f"{MESSAGES[kind].__name__}Wire",
        fields,
        module=__name__,
        kw_only=True,
        frozen=True,
        forbid_unknown_fields=True,
        tag_field="kind",
        tag=kind,
    )
    return wire


class _NoKind(msgspec.Struct, frozen=True, tag_field="kind", tag="\x00"):
    """Never a frame's kind: beside it in a union, a wire type needs ``kind``
    (msgspec reads a lone tagged class without one)."""

    never: _Annotated[int, msgspec.Meta(ge=1, le=0)]  # no value passes: this class is never decoded


TYPES: dict[str, type[msgspec.Struct]] = {kind: wire_type(kind) for kind in HOT_KINDS}
for _kind in HOT_KINDS:  # a checked frame's fields, in order, are its message's (``decoder``)
    assert TYPES[_kind].__struct_fields__ == MESSAGES[_kind].__struct_fields__[:-1], _kind
_MAP_FIELDS = {  # the untyped map fields (a layout is typed: its struct checks it)
    kind: tuple(n for n, t in {**P.SCHEMAS[kind][0], **P.SCHEMAS[kind][1]}.items() if t == "map" and n != "layout")
    for kind in HOT_KINDS
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


_CHECKS = {kind: _post_checks(kind) for kind in HOT_KINDS}


def decoder(
    hot: str | tuple[str, ...], expect_kinds: Iterable[str] | None = None, slow: Slow = P.decode
) -> Callable[[bytes], Any]:
    """``protocol.decode(frame, expect_kinds)``, through the typed decoder of
    the ``hot`` kind(s) first: one per call site, made once.  ``slow`` decodes
    what the typed decoder does not take (a test passes one that counts)."""
    kinds = None if expect_kinds is None else tuple(expect_kinds)
    hots = (hot,) if isinstance(hot, str) else tuple(hot)
    if not hots or any(h not in TYPES or (kinds is not None and h not in kinds) for h in hots):
        raise ValueError(f"{hot!r} is not a hot kind of {kinds}")
    typed = msgspec.msgpack.Decoder(typing.Union[tuple(TYPES[h] for h in hots) + (_NoKind,)]).decode
    cap = P.MAX_FRAME_BYTES
    plain = {TYPES[h]: MESSAGES[h] for h in hots}  # by wire type: a tag is no attribute
    checks = {TYPES[h]: _CHECKS[h] for h in hots}

    def decode(frame: bytes) -> Any:
        if len(frame) <= cap:
            try:
                wire = typed(frame)
            except Exception:  # noqa: BLE001 - any refusal: the slow path names it
                pass
            else:
                wire_type = type(wire)
                check = checks[wire_type]
                if frame[0] < _MAP16 and (check is None or check(wire, len(frame))):
                    return plain[wire_type](*astuple(wire))
        return slow(frame, kinds)

    decode.__doc__ = f"protocol.decode(frame, {kinds}), {', '.join(hots)} on the typed fast path"
    return decode


_body = decoder("body", ("body",))


def decode_body(frame: bytes) -> P.TaskBody:
    """:func:`protocol.decode_body`, the body read on the typed fast path."""
    return P.task_body(_body(frame))
