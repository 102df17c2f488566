"""The zkv wire protocol: message kinds, schemas, and a socket-free codec.

Every frame is one msgpack map carrying ``v`` (the protocol version) and
``kind``.  A swap task travels as two frames, a small header the broker routes
on and a body the broker forwards untouched, so the broker never pays for
decoding block-id lists.  ``docs/protocol.md`` is the normative description;
this module is its executable form and is tested against the golden vectors
under ``tests/vectors``.  No pickle, ever.
"""

from __future__ import annotations

import array
import enum
import re
import sys
from dataclasses import dataclass
from typing import Annotated, Any, Iterable, Sequence, TypeVar, Union, get_args, get_origin

import msgpack
import msgspec

from .bounds import (
    DIGEST_BYTES,
    LIST_MAX,
    MAX_CHECKSUM_IDS,
    MAX_FRAME_BYTES,
    MAX_IDS,
    MAX_KEY_BYTES,
    MAX_NEST_DEPTH,
    MAX_NEST_ITEMS,
    MAX_NS,
    MAX_SAFE_INT,
    MAX_STATS_BYTES,
    MAX_STR,
    MAX_TIER_NAME,
    STR_MAX,
    STR_PATTERN,
    Z85_KEY_LEN,
    uint_bounds,
)
from .errors import LayoutError, ProtocolError, ZkvError, shown  # noqa: F401 - the codec's errors, named here too
from .layout import CacheLayout, LayoutChange
from .messages import MESSAGES, Body, Message, kind_of, wire_fields
from .moves import MOVES
from .nested import nested_ok
from .reply_to import MAX_ADDRESS, is_result_address  # noqa: F401 - the codec names them too
from .vocab import CLIENT_OPS, RANK_OUTCOMES, VERSION, ControlOp, Dtype, Op, Outcome, Tier

#: structs that travel as maps
TYPED_MAPS = (CacheLayout, LayoutChange)

# str fields with a fixed set of values, per (kind, field)
OUTCOMES = tuple(o.value for o in Outcome)
OPS = tuple(o.value for o in Op)
TIERS = tuple(t.value for t in Tier)
_PAIRED = tuple(m.op.value for m in MOVES.values() if not m.keyed)  # the row moves (moves.py): src[i] -> dst[i]
_KEYED = {m.op.value: m for m in MOVES.values() if m.keyed}  # the keyed store's moves: rows[i] <-> keys[i]
_NS_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyz_-")
DTYPES = tuple(d.value for d in Dtype)
CONTROL_OPS = tuple(o.value for o in ControlOp)
_RANK_OUTCOMES = tuple(o.value for o in RANK_OUTCOMES)
_CLIENT_OPS = tuple(o.value for o in CLIENT_OPS)
ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("done", "outcome"): _RANK_OUTCOMES,
    ("result", "outcome"): _RANK_OUTCOMES,
    ("outcome", "outcome"): OUTCOMES,
    ("ack", "op"): _CLIENT_OPS,
    ("control", "op"): _CLIENT_OPS,
    ("welcome", "op"): CONTROL_OPS,
}


# Field types: "uint" is an integer in [0, 2^53), "ids" is a block-id list
# (msgpack array of uint or packed little-endian int32 bytes).
_U, _S, _B, _M, _L, _IDS, _BIN = "uint", "str", "bool", "map", "list", "ids", "bin"


def _plain(annotation: Any) -> Any:
    """A field's annotation without ``None`` and bounds: ``int``, an enum, ``list[...]``, ..."""
    args = tuple(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Union or type(annotation).__name__ == "UnionType":
        if set(args) == {bytes, list[int]}:
            return annotation
        annotation = args[0] if len(args) == 1 else annotation
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _schema_type(annotation: Any) -> str:
    """The schema type of a message field's annotation (``None`` stripped)."""
    annotation = _plain(annotation)
    if set(get_args(annotation)) - {type(None)} == {bytes, list[int]}:
        return _IDS
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _S  # a vocabulary word travels as its str (vocab.py)
    if annotation in TYPED_MAPS:
        return _M  # a layout travels as a map (layout.py types it)
    origin = get_origin(annotation) or annotation
    found = {int: _U, str: _S, bool: _B, dict: _M, list: _L, bytes: _BIN}.get(origin)
    if found is None:
        raise TypeError(f"no schema type for a field of type {annotation!r}")
    return found


def _schema(cls: type[Message]) -> tuple[dict[str, str], dict[str, str]]:
    info = {f.name: f for f in msgspec.structs.fields(cls)}
    names = wire_fields(cls)
    return (
        {n: _schema_type(info[n].type) for n in names if info[n].required},
        {n: _schema_type(info[n].type) for n in names if not info[n].required},
    )


#: kind -> the type of its ``layout`` field (``CacheLayout``, or a resume's ``LayoutChange``)
LAYOUT_TYPES: dict[str, Any] = {
    kind: _plain(f.type) for kind, cls in MESSAGES.items() for f in msgspec.structs.fields(cls) if f.name == "layout"
}
# kind -> (required fields, optional fields), read off the message classes (messages.py)
SCHEMAS: dict[str, tuple[dict[str, str], dict[str, str]]] = {kind: _schema(cls) for kind, cls in MESSAGES.items()}
# kind -> {field: its vocabulary enum}: a decoded word is the enum's member
WORDS: dict[str, dict[str, type[enum.Enum]]] = {
    kind: {
        f.name: _plain(f.type)
        for f in msgspec.structs.fields(cls)
        if isinstance(_plain(f.type), type) and issubclass(_plain(f.type), enum.Enum)
    }
    for kind, cls in MESSAGES.items()
}


def clamp(reason: str) -> str:
    """A reason the bus sends, within the str bound every peer checks (§2.1)."""
    return reason if len(reason) <= MAX_STR else reason[: MAX_STR - 1] + "\u2026"


def is_uint(value: Any, hi: int = MAX_SAFE_INT, lo: int = 0) -> bool:
    """An integer (never a bool or float) in ``lo..hi``."""
    return type(value) is int and lo <= value <= hi


def check_nested(value: Any, where: str, depth: int = 0, budget: list[int] | None = None) -> None:
    """Bound a map / list field in depth and entries, with str keys and
    integers that fit msgpack, so that echoing it in a reply cannot fail."""
    if budget is None and depth == 0 and nested_ok(value):
        return
    budget = budget if budget is not None else [MAX_NEST_ITEMS]
    if depth > MAX_NEST_DEPTH:
        raise ProtocolError("bad_field", f"{where} is nested deeper than {MAX_NEST_DEPTH} levels")
    if isinstance(value, dict):
        items: Iterable[Any] = value.values()
        if any(not isinstance(k, str) or len(k) > MAX_STR for k in value):
            raise ProtocolError("bad_field", f"{where} keys must be str")
    elif isinstance(value, list):
        items = value
    elif isinstance(value, str):
        if len(value) > MAX_STR:
            raise ProtocolError("bad_field", f"{where} holds a string over {MAX_STR} characters")
        return
    elif type(value) is int:
        if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
            raise ProtocolError("bad_field", f"{where} holds an integer beyond 2^53")
        return
    else:
        return  # nil, bool, float, bin: encode as they came
    budget[0] -= len(value)
    if budget[0] < 0:
        raise ProtocolError("bad_field", f"{where} has more than {MAX_NEST_ITEMS} entries")
    for item in items:
        check_nested(item, where, depth + 1, budget)


def _check_uint(kind: str, name: str, value: Any) -> bool:
    lo, hi = uint_bounds(kind, name)
    if type(value) is int and not lo <= value <= hi:
        raise ProtocolError("bad_field", f"{kind}.{name} must be a uint in {lo}..{hi}, got {shown(value)}")
    return is_uint(value)


def _check_str(kind: str, name: str, value: Any) -> bool:
    if not isinstance(value, str):
        return False
    most = STR_MAX.get(name, MAX_STR)
    if len(value) > most:
        raise ProtocolError("bad_field", f"{kind}.{name} is longer than {most} characters")
    pattern = STR_PATTERN.get(name)
    if pattern is not None and not re.match(pattern, value):
        raise ProtocolError("bad_field", f"{kind}.{name} must be 1-{most} characters, none a control character")
    allowed = ENUMS.get((kind, name))
    if allowed is not None and value not in allowed:
        raise ProtocolError("bad_field", f"{kind}.{name} must be one of {', '.join(allowed)}, got {shown(value)}")
    return True


def _check_map(kind: str, name: str, value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    check_nested(value, f"{kind}.{name}")
    if name == "stats" and len(msgpack.packb(value, use_bin_type=True)) > MAX_STATS_BYTES:
        raise ProtocolError("bad_field", f"{kind}.stats encodes to more than {MAX_STATS_BYTES} bytes")
    return True


def _check_list(kind: str, name: str, value: Any) -> bool:
    if not isinstance(value, list):
        return False
    most = LIST_MAX.get(name, MAX_NEST_ITEMS)
    if len(value) > most:
        code = "too_large" if name == "digests" else "bad_field"
        raise ProtocolError(code, f"{kind}.{name} has more than {most} entries")
    if name == "kept_tiers" and not all(isinstance(x, str) and 0 < len(x) <= MAX_TIER_NAME for x in value):
        raise ProtocolError("bad_field", f"{kind}.kept_tiers must be a list of tier names")
    if name == "upto" and not all(is_uint(x) for x in value):
        raise ProtocolError("bad_field", f"{kind}.upto must be a list of uint")
    if name == "digests" and not all(isinstance(x, bytes) and len(x) == DIGEST_BYTES for x in value):
        raise ProtocolError("bad_field", f"{kind}.digests must be {DIGEST_BYTES}-byte bins")
    return True


#: field type -> its check: False for a value of the wrong type (the caller
#: names it), ProtocolError for one out of its bounds.
_FIELD_CHECKS: dict[str, Any] = {
    _U: _check_uint,
    _S: _check_str,
    _B: lambda kind, name, value: isinstance(value, bool),
    _M: _check_map,
    _L: _check_list,
    _BIN: lambda kind, name, value: isinstance(value, (bytes, bytearray)),
    _IDS: lambda kind, name, value: isinstance(value, (bytes, bytearray, list)),
}


def _check_field(kind: str, name: str, value: Any, typ: str) -> None:
    check = _FIELD_CHECKS.get(typ)
    if check is not None and not check(kind, name, value):
        raise ProtocolError("bad_field", f"{kind}.{name} must be {typ}, got {type(value).__name__}")


def validate(msg: Any, expect_kinds: Iterable[str] | None = None) -> dict:
    """Check version, kind and field types of a decoded map; return it."""
    if not isinstance(msg, dict):
        raise ProtocolError("malformed", "a frame must be a msgpack map")
    v = msg.get("v")
    if type(v) is not int or v != VERSION:  # True == 1 and 1.0 == 1 in Python: neither is version 1
        raise ProtocolError("bad_version", f"protocol version {shown(v)} is not supported; this peer speaks v{VERSION}")
    kind = msg.get("kind")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise ProtocolError("unknown_kind", f"unknown message kind {shown(kind)}")
    if expect_kinds is not None and kind not in expect_kinds:
        raise ProtocolError("unknown_kind", f"kind {kind!r} is not valid on this socket")
    required, optional = SCHEMAS[kind]
    for name, typ in required.items():
        if name not in msg:
            raise ProtocolError("bad_field", f"{kind} needs field {name!r}")
        _check_field(kind, name, msg[name], typ)
    for name, typ in optional.items():
        if name in msg and msg[name] is not None:
            _check_field(kind, name, msg[name], typ)
    key = msg.get("reply_key") if "reply_key" in optional else None  # elsewhere an unknown field: ignored
    if key is not None and (len(key) != Z85_KEY_LEN or not all(c in _Z85 for c in key)):
        raise ProtocolError("bad_field", f"{kind}.reply_key must be a Z85 Curve public key of {Z85_KEY_LEN} characters")
    return msg


_Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def encode(kind: str, **fields: Any) -> bytes:
    """Encode one frame; ``fields`` must match the schema of ``kind``."""
    fields["v"] = VERSION
    fields["kind"] = kind
    return msgpack.packb(fields, use_bin_type=True)


def encode_body(op: str, src: Any = None, dst: Any = None, **extra: Any) -> bytes:
    """Encode a task body; id lists go out as packed int32 for speed, a keyed move's
    ``keys`` (a list of bytes) as one packed bin (``pack_keys``)."""
    body: dict[str, Any] = {"v": VERSION, "kind": "body", "op": op}
    if src is not None:
        body["src"] = pack_ids(src)
    if dst is not None:
        body["dst"] = pack_ids(dst)
    if isinstance(extra.get("keys"), (list, tuple)):
        extra = {**extra, "keys": pack_keys(extra["keys"])}
    body.update(extra)
    return msgpack.packb(body, use_bin_type=True)


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """A keyed move's names as one bin: each key a length byte (1..255), then its bytes."""
    out = bytearray()
    for key in keys:
        if not isinstance(key, (bytes, bytearray)) or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a key is 1-{MAX_KEY_BYTES} bytes, got {key!r:.40}")
        out.append(len(key))
        out += key
    return bytes(out)


def unpack_keys(packed: bytes) -> list[bytes]:
    """The keys ``pack_keys`` wrote; ``ProtocolError`` for a torn or empty key, or too many."""
    keys: list[bytes] = []
    at, n = 0, len(packed)
    while at < n:
        size = packed[at]
        if size == 0 or at + 1 + size > n:
            raise ProtocolError("bad_field", f"keys: a key at byte {at} is empty or runs past the end")
        keys.append(bytes(packed[at + 1 : at + 1 + size]))
        at += 1 + size
        if len(keys) > MAX_IDS:
            raise ProtocolError("too_large", f"keys: more than {MAX_IDS}")
    return keys


def decode(frame: bytes, expect_kinds: Iterable[str] | None = None) -> Any:
    """Decode and validate one frame as its typed message (messages.py) or
    raise ProtocolError.  Fields no schema names are ignored, but for a
    ``reply``'s: its op's results, kept in ``extra``."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False, max_map_len=_MAX_MAP_LEN)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("malformed", f"not a msgpack frame ({type(exc).__name__})") from None
    return message(validate(msg, expect_kinds))


M = TypeVar("M", bound=Message)


def decode_as(cls: type[M], frame: bytes) -> M:
    """Decode and validate ``frame`` as a message of ``cls``'s kind; raise ProtocolError otherwise."""
    msg: M = decode(frame, (kind_of(cls),))
    return msg


def message(msg: dict) -> Any:
    """The typed message of a map ``validate`` accepted; a layout's map is typed here,
    its checks by name (``bad_field``)."""
    kind = msg["kind"]
    cls = MESSAGES[kind]
    fields = {name: msg[name] for name in wire_fields(cls) if name in msg}
    if fields.get("layout") is not None:
        try:
            fields["layout"] = LAYOUT_TYPES[kind].from_wire(fields["layout"])
        except ProtocolError as err:
            raise LayoutError(err.reason, kind) from None
    for name, word in WORDS[kind].items():  # validate() let only the enum's words through
        if fields.get(name) is not None:
            fields[name] = word(fields[name])
    if kind == "reply":
        fields["extra"] = {k: v for k, v in msg.items() if k not in fields and k not in ("v", "kind")}
    return cls(**fields)


_MAX_MAP_LEN = 4096  # no zkv map comes near; bounds a decoder's memory per frame


def pack_ids(ids: Any) -> bytes:
    """Pack block ids as little-endian int32 (bytes pass through unchanged).
    An array type (a torch tensor, a numpy array) is taken through its
    ``tolist()``: the wire never imports the libraries that made it."""
    if isinstance(ids, (bytes, bytearray)):
        return bytes(ids)
    if callable(getattr(ids, "tolist", None)):
        ids = ids.tolist()
    arr = array.array("i", ids)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def unpack_ids(value: Any, field: str = "ids") -> list[int]:
    """Turn an ``ids`` field into a list of ints, rejecting what is not ids."""
    if isinstance(value, (bytes, bytearray)):
        if len(value) % 4:
            raise ProtocolError("bad_field", f"{field}: packed ids must be a multiple of 4 bytes, got {len(value)}")
        if len(value) // 4 > MAX_IDS:
            raise ProtocolError("too_large", f"{field}: more than {MAX_IDS} ids")
        arr = array.array("i")
        arr.frombytes(value)
        if sys.byteorder != "little":  # pragma: no cover
            arr.byteswap()
        return arr.tolist()
    if isinstance(value, list):
        if len(value) > MAX_IDS:
            raise ProtocolError("too_large", f"{field}: more than {MAX_IDS} ids")
        for x in value:
            if type(x) is not int or not -(2**31) <= x < 2**31:  # the same range as packed int32
                raise ProtocolError("bad_field", f"{field}: ids must be int32 integers")
        return value
    raise ProtocolError("bad_field", f"{field}: ids must be an array of integers or packed int32 bytes")


@dataclass(slots=True)
class TaskBody:
    """A decoded, shape-checked task body (ranges are the rank's to check).
    Slotted, not frozen: one per task, and a frozen dataclass costs ~1 us more to make."""

    op: str
    src: list[int]
    dst: list[int]
    tier: str = Tier.GPU.value
    seed: int = 0
    keys: list[bytes] | None = None  # a keyed move's names, one per CPU row (``moves.Move.keyed``)
    ns: str = ""  # a keyed move's namespace


_GPU = Tier.GPU.value  # read once: an enum member's .value is a descriptor call


def decode_body(frame: bytes) -> TaskBody:
    """Decode a task body and check what needs no cache layout."""
    return task_body(decode(frame, ("body",)))


def task_body(msg: Body) -> TaskBody:
    """The checks of :func:`decode_body` on a body ``decode`` accepted."""
    op = msg.op
    if op not in OPS:
        raise ProtocolError("bad_field", f"unknown op {shown(op)}; expected one of {', '.join(OPS)}")
    src = unpack_ids(msg.src or [], "src")
    dst = unpack_ids(msg.dst or [], "dst")
    tier = msg.tier
    tier = _GPU if tier is None else tier  # "" is not gpu: only absent / nil is
    if tier not in TIERS:
        raise ProtocolError("bad_field", f"tier must be one of {', '.join(TIERS)}, got {shown(tier)}")
    if op in _PAIRED:
        if len(src) != len(dst):
            raise ProtocolError("bad_field", f"src has {len(src)} ids but dst has {len(dst)}")
        if not src:
            raise ProtocolError("bad_field", f"{op} needs at least one block")
    elif op in _KEYED:
        return _keyed_body(msg, op, src, dst)
    elif tier == Tier.STORE:
        raise ProtocolError("bad_field", f"{op} names no tier store: it holds values by key (fill CPU rows, put them)")
    elif op == Op.FILL and not dst:
        raise ProtocolError("bad_field", "fill needs dst ids")
    elif op == Op.CHECKSUM and not src:
        raise ProtocolError("bad_field", "checksum needs src ids")
    elif op == Op.CHECKSUM and len(src) > MAX_CHECKSUM_IDS:  # its digests must fit one result frame
        raise ProtocolError("too_large", f"checksum of {len(src)} blocks; at most {MAX_CHECKSUM_IDS} per task")
    return TaskBody(op, src, dst, tier, msg.seed or 0)


def _keyed_body(msg: Body, op: str, src: list[int], dst: list[int]) -> TaskBody:
    """A put or get: its CPU rows (``src`` of a put, ``dst`` of a get) and as many keys, each
    once, in a namespace of 1-``MAX_NS`` characters of ``[0-9a-z_-]``; nothing on the store's side."""
    rows, other = (src, dst) if _KEYED[op].rows == "src" else (dst, src)
    if other:
        raise ProtocolError("bad_field", f"{op} names the store by keys, not by ids: only its CPU rows are ids")
    if not rows:
        raise ProtocolError("bad_field", f"{op} needs at least one CPU row")
    keys = unpack_keys(msg.keys or b"")
    if len(keys) != len(rows):
        raise ProtocolError("bad_field", f"{op} names {len(rows)} CPU rows but {len(keys)} keys")
    if len(set(keys)) != len(keys):
        raise ProtocolError("bad_field", f"{op} names a key twice")
    ns = msg.ns or ""
    if not 1 <= len(ns) <= MAX_NS or not _NS_CHARS.issuperset(ns):
        raise ProtocolError("bad_field", f"{op} needs ns: 1-{MAX_NS} characters of [0-9a-z_-], got {shown(ns)}")
    return TaskBody(op, src, dst, Tier.CPU.value, 0, keys, ns)


def salvage_ids(frame: bytes) -> dict[str, int]:
    """``req`` / ``task`` of a frame that failed validation, when readable, so
    the error reply can still be matched to its request."""
    if len(frame) > MAX_FRAME_BYTES:
        return {}
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False, max_map_len=_MAX_MAP_LEN)
    except Exception:
        return {}
    if not isinstance(msg, dict):
        return {}
    found: dict[str, int] = {}
    for key in ("req", "task"):
        value = msg.get(key)
        if type(value) is int and is_uint(value):
            found[key] = value
    return found


def check_frames(frames: Sequence[bytes], lo: int, hi: int) -> None:
    """Cap frames per message: libzmq's MAXMSGSIZE is per frame only."""
    if not lo <= len(frames) <= hi:
        raise ProtocolError("malformed", f"expected {lo}..{hi} frames, got {len(frames)}")
