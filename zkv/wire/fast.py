"""The typed fast path of the hot message kinds: ``submit``, ``task``,
``done``, ``result`` and the task ``body``, the frames every task sends.

Rule 1: it accepts only what :func:`protocol.decode` accepts, and returns the
message that would (same class, fields, values and types).  msgspec decodes a
frame into the kind's message class (messages.py), checking types (a bool or
a float is not an int), ranges, enums and string lengths in C, refusing an
unknown field (msgspec would skip its value without the checks msgpack makes)
and reading a repeated key as msgpack does (the last one wins).  A frame it
refuses goes to ``protocol.decode``, so every refusal is that codec's own
ProtocolError, code and reason.  So does a frame not written as a fixmap (more
than 15 entries: msgpack bounds a map's entries, msgspec does not).

It decodes into a subclass of the message class that requires ``v`` (msgspec
has no field that is required on the wire yet defaulted in Python); a message
equals the same message made by hand (``Message.__eq__``).

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

from . import protocol as P
from .messages import MESSAGES, Message

HOT_KINDS = ("submit", "task", "done", "result", "body")
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


def _field_type(kind: str, name: str, typ: str) -> Any:
    """The msgspec type that accepts a subset of what ``_check_field`` does."""
    if typ == "uint":
        lo, hi = P.uint_bounds(kind, name)
        return _Annotated[int, msgspec.Meta(ge=lo, le=hi)]
    if typ == "str":
        allowed = P.ENUMS.get((kind, name))
        word = P.WORDS[kind].get(name)
        if word is not None:  # msgspec decodes its member, as protocol.message makes it
            if allowed is None or tuple(w.value for w in word) != tuple(allowed):
                raise TypeError(f"{kind}.{name}: its enum {word.__name__} is not protocol.ENUMS' words")
            return word
        return _str(name) if allowed is None else _Literal[allowed]
    if typ == "bool":
        return bool
    if typ == "bin":
        return bytes
    if typ == "ids":  # int32 range, MAX_IDS and whole int32s are task_body's to check, as for the slow path
        return bytes | list[int]
    if (typ, name) == ("list", "digests"):
        digest = _Annotated[bytes, msgspec.Meta(min_length=P.DIGEST_BYTES, max_length=P.DIGEST_BYTES)]
        return _Annotated[list[digest], msgspec.Meta(max_length=P.LIST_MAX["digests"])]  # type: ignore[valid-type]
    raise TypeError(
        f"the fast codec has no type for {kind}.{name} ({typ}); add one or leave the kind to protocol.decode"
    )


def wire_type(kind: str) -> type[Message]:
    """``kind``'s message class with its fields bounded as the tables say and
    ``v`` required; optional fields stay nil-able (``validate`` and the call
    sites take a nil as absent)."""
    required, optional = P.SCHEMAS[kind]
    fields: list[Any] = [(n, _field_type(kind, n, t)) for n, t in required.items()]
    fields += [(n, typing.Optional[_field_type(kind, n, t)], None) for n, t in optional.items()]
    fields.append(("v", _Literal[P.VERSION]))
    cls = MESSAGES[kind]
    wire: Any = msgspec.defstruct(
        cls.__name__,
        fields,
        bases=(cls,),
        module=__name__,
        kw_only=True,
        frozen=True,
        forbid_unknown_fields=True,
        tag=kind,
    )
    return wire


class _NoKind(Message, frozen=True, tag="\x00"):
    """Never a frame's kind: beside it in a union, a message class needs ``kind``
    (msgspec reads a lone tagged class without one)."""

    never: _Annotated[int, msgspec.Meta(ge=1, le=0)]  # no value passes: this class is never decoded


TYPES: dict[str, type[Message]] = {kind: wire_type(kind) for kind in HOT_KINDS}
_TYPED: dict[str, Callable[[bytes], Any]] = {
    kind: msgspec.msgpack.Decoder(typing.Union[t, _NoKind]).decode for kind, t in TYPES.items()
}
Slow = Callable[[bytes, "tuple[str, ...] | None"], Any]


def decoder(hot: str, expect_kinds: Iterable[str] | None = None, slow: Slow = P.decode) -> Callable[[bytes], Any]:
    """``protocol.decode(frame, expect_kinds)``, through ``hot``'s typed
    decoder first: one per call site, made once.  ``slow`` decodes what the
    typed decoder does not take (a test passes one that counts)."""
    kinds = None if expect_kinds is None else tuple(expect_kinds)
    if hot not in _TYPED or (kinds is not None and hot not in kinds):
        raise ValueError(f"{hot!r} is not a hot kind of {kinds}")
    typed, cap = _TYPED[hot], P.MAX_FRAME_BYTES

    def decode(frame: bytes) -> Any:
        if len(frame) <= cap:
            try:
                msg = typed(frame)
            except Exception:  # noqa: BLE001 - any refusal: the slow path names it
                pass
            else:
                if frame[0] < _MAP16:
                    return msg
        return slow(frame, kinds)

    decode.__doc__ = f"protocol.decode(frame, {kinds}), {hot} on the typed fast path"
    return decode


_body = decoder("body", ("body",))


def decode_body(frame: bytes) -> P.TaskBody:
    """:func:`protocol.decode_body`, the body read on the typed fast path."""
    return P.task_body(_body(frame))
