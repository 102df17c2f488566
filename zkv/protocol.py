"""The zkv wire protocol: message kinds, schemas, and a socket-free codec.

Every frame is one msgpack map carrying ``v`` (the protocol version) and
``kind``.  A swap task travels as two frames, a small header the broker routes
on and a body the broker forwards untouched, so the broker never pays for
decoding block-id lists.  ``docs/protocol.md`` is the normative description;
this module is its executable form and is tested against the golden vectors
under ``tests/vectors``.  No pickle, ever.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgpack

VERSION = 1
MAX_SAFE_INT = 2**53 - 1
MAX_FRAME_BYTES = 16 * 1024 * 1024  # application cap, answered with too_large
MAX_IDS = 1 << 20

OUTCOMES = ("ok", "failed", "cancelled", "rejected", "timeout")
OPS = ("swap_out", "swap_in", "fill", "checksum")
TIERS = ("gpu", "cpu")
DTYPES = ("bf16", "fp16", "fp32")


class ProtocolError(Exception):
    """A message that breaks the protocol; ``code`` is the wire error code."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


# Field types: "uint" is an integer in [0, 2^53), "ids" is a block-id list
# (msgpack array of uint or packed little-endian int32 bytes).
_U, _S, _B, _M, _L, _IDS, _BIN = "uint", "str", "bool", "map", "list", "ids", "bin"

# kind -> (required fields, optional fields)
SCHEMAS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    # client -> broker (frontend)
    "submit": ({"task": _U, "reply_to": _S}, {"timeout_ms": _U, "reply_key": _S}),
    "pause": ({"req": _U}, {"timeout_ms": _U}),
    "clear": ({"req": _U}, {"timeout_ms": _U, "keep_cpu": _B}),
    "resume": ({"req": _U}, {"timeout_ms": _U, "layout": _M}),
    "status": ({"req": _U}, {"wait_ranks": _U, "timeout_ms": _U}),
    "ping": ({"req": _U}, {}),
    # broker -> client (frontend)
    "reply": ({"req": _U, "op": _S}, {}),
    "error": ({"code": _S, "reason": _S}, {"req": _U, "task": _U}),
    "outcome": ({"task": _U, "outcome": _S, "reason": _S}, {"gen": _U}),
    # rank -> broker (backend)
    "ready": ({"rank": _U, "world": _U, "session": _U, "layout": _M, "gen": _U}, {"pid": _U, "fresh": _B, "has_cache": _B}),
    "hb": ({}, {"inflight": _U, "stats": _M, "probe": _B}),
    "done": ({"seq": _U, "n": _U, "outcome": _S, "gen": _U}, {"bytes": _U}),
    "ack": ({"epoch": _U, "op": _S}, {"upto": _U, "freed": _U, "gen": _U, "layout": _M, "stats": _M, "error": _S, "cpu_kept": _B}),
    # broker -> rank (backend)
    "welcome": ({"epoch": _U, "op": _S, "gen": _U, "upto": _U, "layout": _M, "heartbeat_ms": _U}, {"keep_cpu": _B, "session": _U}),
    "refused": ({"reason": _S}, {}),
    "reregister": ({}, {}),
    "task": ({"seq": _U, "n": _U, "task": _U, "reply_to": _S, "gen": _U}, {"reply_key": _S, "session": _U}),
    # broker -> ranks (PUB)
    "control": ({"epoch": _U, "op": _S, "gen": _U, "upto": _L}, {"keep_cpu": _B, "layout": _M}),
    # rank -> client (PUSH)
    "result": (
        {"task": _U, "rank": _U, "world": _U, "outcome": _S, "reason": _S, "gen": _U},
        {"bytes": _U, "elapsed_us": _U, "digests": _L},
    ),
    # task body (second frame of submit and task)
    "body": ({"op": _S}, {"src": _IDS, "dst": _IDS, "tier": _S, "seed": _U}),
}

CONTROL_OPS = ("run", "pause", "clear", "resume")


def _check_field(kind: str, name: str, value: Any, typ: str) -> None:
    ok = True
    if typ == _U:
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SAFE_INT
    elif typ == _S:
        ok = isinstance(value, str)
    elif typ == _B:
        ok = isinstance(value, bool)
    elif typ == _M:
        ok = isinstance(value, dict)
    elif typ == _L:
        ok = isinstance(value, list)
    elif typ == _BIN:
        ok = isinstance(value, (bytes, bytearray))
    elif typ == _IDS:
        ok = isinstance(value, (bytes, bytearray, list))
    if not ok:
        raise ProtocolError("bad_field", f"{kind}.{name} must be {typ}, got {type(value).__name__}")


def validate(msg: Any, expect_kinds: Iterable[str] | None = None) -> dict:
    """Check version, kind and field types; return the message (a dict)."""
    if not isinstance(msg, dict):
        raise ProtocolError("malformed", "a frame must be a msgpack map")
    v = msg.get("v")
    if v != VERSION:
        raise ProtocolError("bad_version", f"protocol version {v!r} is not supported; this peer speaks v{VERSION}")
    kind = msg.get("kind")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise ProtocolError("unknown_kind", f"unknown message kind {kind!r}")
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
    return msg


def encode(kind: str, **fields: Any) -> bytes:
    """Encode one frame; ``fields`` must match the schema of ``kind``."""
    fields["v"] = VERSION
    fields["kind"] = kind
    return msgpack.packb(fields, use_bin_type=True)


def encode_body(op: str, src: Any = None, dst: Any = None, **extra: Any) -> bytes:
    """Encode a task body; id lists go out as packed int32 for speed."""
    body: dict[str, Any] = {"v": VERSION, "kind": "body", "op": op}
    if src is not None:
        body["src"] = pack_ids(src)
    if dst is not None:
        body["dst"] = pack_ids(dst)
    body.update(extra)
    return msgpack.packb(body, use_bin_type=True)


def decode(frame: bytes, expect_kinds: Iterable[str] | None = None) -> dict:
    """Decode and validate one frame or raise ProtocolError."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("malformed", f"not a msgpack frame ({type(exc).__name__})") from None
    return validate(msg, expect_kinds)


def pack_ids(ids: Any) -> bytes:
    """Pack block ids as little-endian int32 (bytes pass through unchanged)."""
    if isinstance(ids, (bytes, bytearray)):
        return bytes(ids)
    if type(ids).__module__.startswith("torch"):  # a tensor; never import torch for a list
        from .kvcache import tensor_bytes

        return tensor_bytes(ids.to(dtype=__import__("torch").int32))
    import array

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
        import array

        arr = array.array("i")
        arr.frombytes(value)
        if sys.byteorder != "little":  # pragma: no cover
            arr.byteswap()
        return arr.tolist()
    if isinstance(value, list):
        if len(value) > MAX_IDS:
            raise ProtocolError("too_large", f"{field}: more than {MAX_IDS} ids")
        for x in value:
            if not isinstance(x, int) or isinstance(x, bool):
                raise ProtocolError("bad_field", f"{field}: ids must be integers")
        return value
    raise ProtocolError("bad_field", f"{field}: ids must be an array of integers or packed int32 bytes")


@dataclass(frozen=True)
class TaskBody:
    """A decoded, shape-checked task body (ranges are the rank's to check)."""

    op: str
    src: list[int]
    dst: list[int]
    tier: str = "gpu"
    seed: int = 0


def decode_body(frame: bytes) -> TaskBody:
    """Decode a task body and check what needs no cache layout."""
    msg = decode(frame, ("body",))
    op = msg["op"]
    if op not in OPS:
        raise ProtocolError("bad_field", f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    src = unpack_ids(msg.get("src") or [], "src")
    dst = unpack_ids(msg.get("dst") or [], "dst")
    tier = msg.get("tier") or "gpu"
    if tier not in TIERS:
        raise ProtocolError("bad_field", f"tier must be gpu or cpu, got {tier!r}")
    if op in ("swap_out", "swap_in"):
        if len(src) != len(dst):
            raise ProtocolError("bad_field", f"src has {len(src)} ids but dst has {len(dst)}")
        if not src:
            raise ProtocolError("bad_field", "a swap needs at least one block")
    elif op == "fill" and not dst:
        raise ProtocolError("bad_field", "fill needs dst ids")
    elif op == "checksum" and not src:
        raise ProtocolError("bad_field", "checksum needs src ids")
    return TaskBody(op, src, dst, tier, msg.get("seed") or 0)


def salvage_ids(frame: bytes) -> dict[str, int]:
    """``req`` / ``task`` of a frame that failed validation, when readable, so
    the error reply can still be matched to its request."""
    if len(frame) > MAX_FRAME_BYTES:
        return {}
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return {}
    if not isinstance(msg, dict):
        return {}
    found = {}
    for key in ("req", "task"):
        value = msg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SAFE_INT:
            found[key] = value
    return found


def check_frames(frames: Sequence[bytes], lo: int, hi: int) -> None:
    """Cap frames per message: libzmq's MAXMSGSIZE is per frame only."""
    if not lo <= len(frames) <= hi:
        raise ProtocolError("malformed", f"expected {lo}..{hi} frames, got {len(frames)}")
