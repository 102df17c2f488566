"""The typed decoder of each socket (zkv/wire/fast.py) against the validating
codec: what a typed decoder accepts, ``protocol.decode`` accepts with the same
message (same class, fields, values *and types*: ``True == 1`` in Python, so
every comparison here is type-strict); what it does not take ends in
``protocol.decode``'s own ProtocolError, code and reason.

Checked for every kind, through the decoder of that kind alone, of every
socket that receives it (zkv/wire/sockets.py) and of every kind at once: on
every golden vector, on each msgspec behaviour that could differ from
msgpack's (bool or float for an int, nil, extra fields, duplicate keys,
non-str keys, long strings, trailing bytes, ids), and by a hypothesis property
over generated and mutated maps.  ``ZKV_LONG_FUZZ=1`` runs the property long.
"""

from __future__ import annotations

import enum
import functools
import os
import re
import struct
from pathlib import Path

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_protocol import INVALID, VALID, _message, from_json
from test_protocol import read as kept

from zkv.wire import bounds
from zkv.wire import fast as F
from zkv.wire import protocol as P
from zkv.wire import sockets as S
from zkv.wire.messages import MESSAGES, Message, Reply, wire_fields

LONG = os.environ.get("ZKV_LONG_FUZZ") == "1"
KINDS = tuple(MESSAGES)
ALL = KINDS  # a decoder of every kind reads a frame as protocol.decode(frame) does
UINT_KINDS = [k for k in KINDS if "uint" in P.SCHEMAS[k][0].values()]
OPTIONAL_KINDS = [k for k in KINDS if P.SCHEMAS[k][1]]
Z85_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
REPLY_TO = "tcp://127.0.0.1:5555"
LAYOUT = {"layers": 2, "gpu_blocks": 64}
BASE = {  # one valid map of each kind, every optional field present
    "submit": {"task": 1, "reply_to": REPLY_TO, "timeout_ms": 5000, "reply_key": Z85_KEY, "batch_results": True},
    "pause": {"req": 1, "timeout_ms": 5000},
    "clear": {"req": 2, "timeout_ms": 5000, "keep_cpu": True, "weights": "step-1"},
    "resume": {"req": 3, "timeout_ms": 5000, "layout": {"gpu_blocks": 32}},
    "status": {"req": 4, "wait_ranks": 2, "timeout_ms": 100},
    "ping": {"req": 5},
    "cancel": {"req": 6, "task": 9},
    "reply": {"req": 7, "op": "ping"},
    "error": {"code": "bad_field", "reason": "submit.task must be a uint", "req": 8, "task": 9},
    "outcome": {"task": 1, "outcome": "cancelled", "reason": "cleared", "gen": 2, "cpu_gen": 1, "ran": False},
    "ready": {
        "rank": 1,
        "world": 2,
        "session": 7,
        "layout": LAYOUT,
        "gen": 1,
        "pid": 4242,
        "fresh": True,
        "has_cache": True,
        "host": "node-1",
        "kept_tiers": ["cpu", "disk"],
        "cpu_gen": 3,
        "adopt_layout": False,
    },
    "hb": {"inflight": 2, "stats": {"tasks_ok": 7, "op": "run", "x": None, "ok": False}, "probe": True},
    "done": {"seq": 1, "n": 1, "outcome": "ok", "gen": 1, "bytes": 4096},
    "ack": {
        "epoch": 3,
        "op": "resume",
        "gen": 2,
        "upto": 9,
        "freed": 4096,
        "layout": LAYOUT,
        "cpu_kept": True,
        "stats": {"tasks_ok": 7, "device": "cpu", "copy_seconds": 0.25, "cpu_tier": {"rows": [1, {"k": []}]}},
        "error": "",
    },
    "welcome": {
        "epoch": 1,
        "op": "run",
        "gen": 1,
        "upto": 0,
        "layout": LAYOUT,
        "heartbeat_ms": 500,
        "keep_cpu": False,
        "session": 7,
    },
    "refused": {"reason": "bad layout"},
    "reregister": {},
    "task": {
        "seq": 1,
        "n": 1,
        "task": 1,
        "reply_to": REPLY_TO,
        "gen": 1,
        "reply_key": Z85_KEY,
        "session": 7,
        "cpu_gen": 3,
        "batch_results": True,
    },
    "control": {"epoch": 4, "op": "resume", "gen": 3, "upto": [7, 0], "keep_cpu": False, "layout": {"gpu_blocks": 32}},
    "result": {
        "task": 1,
        "rank": 0,
        "world": 2,
        "outcome": "ok",
        "reason": "",
        "gen": 1,
        "bytes": 4096,
        "elapsed_us": 9,
        "digests": [b"\x01" * 16],
        "cpu_gen": 3,
    },
    "body": {
        "op": "swap_out",
        "src": P.pack_ids([1, 2]),
        "dst": P.pack_ids([3, 4]),
        "tier": "gpu",
        "seed": 0,
        "keys": P.pack_keys([b"k1", b"k2"]),
        "ns": "n0",
    },
}


def same(a, b) -> bool:
    """Equal and of the same types all the way down (``True == 1`` is not enough)."""
    if isinstance(a, Message) and isinstance(b, Message):
        cls = MESSAGES[a.kind]
        return (
            type(a) is cls and type(b) is cls and all(same(getattr(a, n), getattr(b, n)) for n in cls.__struct_fields__)
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def outcome(decode, *args):
    """("ok", the message) or ("error", (code, reason))."""
    try:
        return "ok", decode(*args)
    except P.ProtocolError as err:
        return "error", (err.code, err.reason)


class Counted:
    """The decoder of a socket of ``kinds`` whose slow path counts: was the typed path enough?"""

    def __init__(self, kinds):
        self.fallbacks = 0
        self.decode = F.decoder(kinds, slow=self._slow)

    def _slow(self, frame, kinds):
        self.fallbacks += 1
        return P.decode(frame, kinds)


@functools.cache
def counted(kinds: tuple[str, ...]) -> Counted:
    """One per set of kinds, made once (as a socket's is)."""
    return Counted(kinds)


def check_agrees(kinds, frame, only=None) -> bool:
    """The decoder of ``kinds`` (narrowed to ``only``) and protocol.decode agree
    on ``frame``; True when the typed path alone took it."""
    dec = counted(tuple(kinds))
    dec.fallbacks = 0
    fast = outcome(dec.decode, frame, only)
    slow = outcome(P.decode, frame, kinds if only is None else only)
    assert fast[0] == slow[0], (kinds, only, fast, slow)
    assert same(fast[1], slow[1]), (kinds, only, fast, slow)
    if tuple(kinds) == ("body",):
        assert outcome(F.decode_body, frame) == outcome(P.decode_body, frame)
    return dec.fallbacks == 0


def decoders_of(kind) -> list[tuple[str, ...]]:
    """The sets of kinds whose decoder reads ``kind``: its own alone, every
    socket's that receives it, every kind's."""
    found = [(kind,), *(kinds for kinds in S.SOCKETS.values() if kind in kinds and kinds != (kind,)), ALL]
    return found


def typed_path(kind, frame) -> bool:
    """Every decoder of ``kind`` agrees with protocol.decode on ``frame``, and
    they all take it on the typed path (True) or all leave it to the slow one."""
    taken = {check_agrees(kinds, frame) for kinds in decoders_of(kind)}
    assert len(taken) == 1, f"the decoders of {kind} disagree on the path"
    return taken.pop()


def frame_of(kind, fields, **changes):
    msg = {**fields, "v": 1, "kind": kind, **changes}
    return msgpack.packb({k: v for k, v in msg.items() if v is not _DROP}, use_bin_type=True)


_DROP = object()


def raw_map(pairs) -> bytes:
    """A map written entry by entry: keys may repeat, or be of any type."""
    head = bytes([0x80 + len(pairs)]) if len(pairs) < 16 else b"\xde" + struct.pack(">H", len(pairs))
    return head + b"".join(msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True) for k, v in pairs)


# --- the tables ------------------------------------------------------------------------


def test_every_kind_has_a_base_map():
    assert set(BASE) == set(KINDS)
    for kind, fields in BASE.items():
        assert set(fields) == {*P.SCHEMAS[kind][0], *P.SCHEMAS[kind][1]}, kind


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_a_type_from_the_schema(kind):
    required, optional = P.SCHEMAS[kind]
    for tagged in (True, False):
        typ = F.TYPES[kind] if tagged else F.wire_type(kind, tagged=False)
        fields = {f.name: f for f in msgspec.structs.fields(typ)}
        assert not issubclass(typ, MESSAGES[kind])
        assert list(fields) == [*wire_fields(MESSAGES[kind]), "v", *(() if tagged else ("kind",))]
        assert {n for n, f in fields.items() if f.required} == {"v", *required, *(() if tagged else ("kind",))}
        assert typ.__struct_config__.tag == (kind if tagged else None)


def test_a_decoder_is_made_of_message_kinds_once_each():
    for bad in ((), ("launch",), ("done", "done"), ("done", "launch")):
        with pytest.raises(ValueError):
            F.decoder(bad)
    with pytest.raises(TypeError):
        F.decoder("done")  # a str is no set of kinds


def _doc_sections() -> dict[str, str]:
    """docs/protocol.md §4's sections, by their heading."""
    text = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    parts = re.split(r"^### (4\.\d [^\n]*)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


_SECTION_OF = {  # which section of docs/protocol.md §4 lists what each socket receives
    "broker frontend": "4.1 Client → broker (frontend)",
    "client dealer": "4.2 Broker → client (frontend)",
    "client pull": "4.3 Rank → client (PUSH → PULL)",
    "broker backend": "4.4 Rank → broker (backend)",
    "rank dealer": "4.5 Broker → rank (backend)",
    "rank sub": "4.6 Broker → ranks (PUB)",
}


def test_each_socket_takes_the_kinds_its_section_of_the_protocol_lists():
    sections = _doc_sections()
    assert set(_SECTION_OF) == set(S.SOCKETS)
    for socket, kinds in S.SOCKETS.items():
        (heading,) = [h for h in sections if h.startswith(_SECTION_OF[socket])]
        listed = re.findall(r"^\| `([a-z_]+)` \|", sections[heading], flags=re.M)
        assert tuple(listed) == kinds, socket
    received = {kind for kinds in S.SOCKETS.values() for kind in kinds}
    assert received == set(KINDS) - {"body"}  # a body is the second frame of a submit or task, read on its own
    assert set(S.BATCHED_DONE) <= set(S.BROKER_BACKEND) and set(S.TASK_HEADER) <= set(S.RANK_DEALER)


def test_each_golden_vector_travels_on_a_socket_that_takes_its_kind():
    where = {  # the vectors' socket and direction -> the socket that receives them
        ("frontend", "client->broker"): S.BROKER_FRONTEND,
        ("frontend", "broker->client"): S.CLIENT_DEALER,
        ("backend", "rank->broker"): S.BROKER_BACKEND,
        ("backend", "broker->rank"): S.RANK_DEALER,
        ("control", "broker->ranks"): S.RANK_SUB,
        ("results", "rank->client"): S.CLIENT_PULL,
    }
    for vec in VALID:
        if vec["kind"] != "body":
            assert vec["kind"] in where[vec["socket"], vec["direction"]], vec["name"]


# --- golden vectors ------------------------------------------------------------------------


DECODE_INVALID = [v for v in INVALID if v["decoder"] in ("decode", "decode_body")]


def _plain_fields(vec) -> bool:
    """A vector whose map holds only its kind's own fields, in a fixmap: the typed path's."""
    decoded = from_json(vec["decoded"])
    kind = vec["kind"]
    return set(decoded) <= {*P.SCHEMAS[kind][0], *P.SCHEMAS[kind][1], "v", "kind"} and len(decoded) < 16


@pytest.mark.parametrize("vec", VALID, ids=[v["name"] for v in VALID])
def test_valid_vector_reads_as_protocol_decode_reads_it(vec):
    frame = bytes.fromhex(vec["hex"])
    kind = vec["kind"]
    assert typed_path(kind, frame) == _plain_fields(vec), "a golden vector of plain fields left the typed path"
    msg = F.decoder((kind,))(frame)
    read = {k: v.value if isinstance(v, enum.Enum) else v for k, v in msg.to_dict().items()}  # the words as sent
    read, decoded = {**read, "v": 1, "kind": msg.kind}, kept(from_json(vec["decoded"]))
    assert same(dict(sorted(read.items())), dict(sorted(decoded.items())))
    if kind == "body":
        assert F.decode_body(frame) == P.decode_body(frame)


@pytest.mark.parametrize("vec", DECODE_INVALID, ids=[v["name"] for v in DECODE_INVALID])
def test_invalid_vector_raises_the_slow_paths_error(vec):
    frame = bytes.fromhex(vec["hex"])
    if vec["decoder"] == "decode_body":
        with pytest.raises(P.ProtocolError) as fast:
            F.decode_body(frame)
        with pytest.raises(P.ProtocolError) as slow:
            P.decode_body(frame)
        assert (fast.value.code, fast.value.reason) == (slow.value.code, slow.value.reason) and fast.value.code == vec[
            "code"
        ]
        return
    kinds = ALL if vec["expect_kinds"] is None else tuple(vec["expect_kinds"])
    assert not check_agrees(kinds, frame)
    for socket in S.SOCKETS.values():  # every socket's decoder: what protocol.decode says there
        check_agrees(socket, frame)
    with pytest.raises(P.ProtocolError) as info:
        counted(kinds).decode(frame)
    assert info.value.code == vec["code"]


# --- what msgspec reads differently from msgpack ---------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_full_map_takes_the_typed_path(kind):
    assert typed_path(kind, frame_of(kind, BASE[kind]))


@pytest.mark.parametrize("value", [True, False, 1.0, 0.0, -1, 2**53, 2**64 - 1, "1", b"\x01", None, [1], {"a": 1}])
@pytest.mark.parametrize("kind", UINT_KINDS)
def test_an_integer_field_takes_only_an_int(kind, value):
    name = next(n for n, t in P.SCHEMAS[kind][0].items() if t == "uint")
    assert not typed_path(kind, frame_of(kind, BASE[kind], **{name: value}))


@pytest.mark.parametrize("kind", ["done", "reregister", "ping"])
@pytest.mark.parametrize("v", [True, 1.0, 2, 0, "1", None, _DROP])
def test_version_is_exactly_the_int_1(v, kind):
    frame = (
        frame_of(kind, BASE[kind], v=v)
        if v is not _DROP
        else raw_map([(k, x) for k, x in {**BASE[kind], "kind": kind}.items()])
    )
    assert not typed_path(kind, frame)
    with pytest.raises(P.ProtocolError) as info:
        F.decoder((kind,))(frame)
    assert info.value.code == "bad_version"


def test_version_as_a_wide_int_is_still_1():
    frame = frame_of("done", BASE["done"])
    wide = frame.replace(b"\xa1v\x01", b"\xa1v\xcf" + (1).to_bytes(8, "big"))  # uint64 1
    assert wide != frame and msgpack.unpackb(wide)["v"] == 1
    assert typed_path("done", wide)
    assert not typed_path("done", frame.replace(b"\xa1v\x01", b"\xa1v\xd4\x00\x01"))  # an ext is not an int


@pytest.mark.parametrize("kind", KINDS)
def test_kind_is_required_by_every_decoder(kind):
    pairs = [*BASE[kind].items(), ("v", 1)]
    for frame in (raw_map(pairs), raw_map([*pairs, ("kind", None)]), raw_map([*pairs, ("kind", kind.encode())])):
        assert not typed_path(kind, frame)
        with pytest.raises(P.ProtocolError) as info:
            F.decoder((kind,))(frame)
        assert info.value.code == "unknown_kind"


@pytest.mark.parametrize("kind", OPTIONAL_KINDS)
def test_nil_optional_reads_as_absent_as_the_slow_path_has_it(kind):
    for name in P.SCHEMAS[kind][1]:
        frame = frame_of(kind, BASE[kind], **{name: None})
        assert typed_path(kind, frame)
        assert getattr(F.decoder((kind,))(frame), name) is None


@pytest.mark.parametrize("kind", KINDS)
def test_absent_optionals(kind):
    required = {k: v for k, v in BASE[kind].items() if k in P.SCHEMAS[kind][0]}
    assert typed_path(kind, frame_of(kind, required))


@pytest.mark.parametrize("kind", KINDS)
def test_missing_required_field_is_the_slow_paths_error(kind):
    for name in P.SCHEMAS[kind][0]:
        assert not typed_path(kind, frame_of(kind, BASE[kind], **{name: _DROP}))


@pytest.mark.parametrize(
    "extra",
    [1, "x", None, {"a": [1, 2]}, {1: 2}, [[]], msgpack.ExtType(5, b"x"), msgpack.Timestamp(1, 0), 2**64 - 1, -(2**63)],
)
@pytest.mark.parametrize("kind", KINDS)
def test_unknown_field_goes_to_the_slow_path_which_ignores_it(kind, extra):
    frame = frame_of(kind, BASE[kind], zz_extra=extra)
    assert not typed_path(kind, frame)
    plain = F.decoder((kind,))(frame_of(kind, BASE[kind]))
    if kind == "reply":  # but a reply's: its op's results, kept beside its fields
        plain = Reply(req=plain.req, op=plain.op, extra={"zz_extra": P.decode(frame).extra["zz_extra"]})
    assert same(F.decoder((kind,))(frame), plain)


def test_unknown_field_whose_value_msgpack_refuses_is_refused():
    # msgspec skips an unknown field without looking: a map key msgpack cannot
    # hash, or bad UTF-8, would pass it; the slow path names the frame malformed.
    good = frame_of("done", BASE["done"])
    bad_utf8 = bytes([good[0] + 1]) + good[1:] + msgpack.packb("zz") + b"\xa1\xff"
    unhashable = bytes([good[0] + 1]) + good[1:] + msgpack.packb("zz") + b"\x81\x80\x01"  # {{}: 1}
    for frame in (bad_utf8, unhashable):
        for kinds in decoders_of("done"):
            with pytest.raises(P.ProtocolError) as info:
                F.decoder(kinds)(frame)
            assert info.value.code == "malformed"


def test_map_wider_than_the_slow_paths_bound_is_refused():
    pairs = [("v", 1), ("kind", "done")] + [("seq", 1)] * 4100 + [(k, v) for k, v in BASE["done"].items()]
    frame = b"\xdf" + struct.pack(">I", len(pairs)) + raw_map(pairs)[3:]
    for kinds in decoders_of("done"):
        with pytest.raises(P.ProtocolError) as info:
            F.decoder(kinds)(frame)
        assert info.value.code == "malformed"


def test_duplicate_keys_read_as_msgpack_reads_them():
    fields = list({**BASE["done"], "v": 1, "kind": "done"}.items())
    typed = [  # msgspec reads a repeated key as msgpack does: the last one wins
        fields + [("seq", 2)],
        fields + [("bytes", None)],
        [("bytes", None)] + fields,
    ]
    slow = [
        fields + [("seq", True)],  # a bad last one: refused
        [("seq", True)] + fields,  # a bad first one: the last wins
        fields + [("v", 2)],
        [("v", 2)] + fields,
    ]
    for pairs in typed:
        assert typed_path("done", raw_map(pairs))
    for pairs in slow:
        assert not typed_path("done", raw_map(pairs))
    for pairs in (fields + [("kind", "hb")], [("kind", "hb")] + fields):  # a kind named twice: the last one
        for kinds in decoders_of("done") + decoders_of("hb"):
            check_agrees(kinds, raw_map(pairs))
    assert F.decoder(("done",))(raw_map(fields + [("seq", 2)])).seq == 2
    assert F.decoder(("done",))(raw_map(fields + [("bytes", None)])).bytes is None
    assert same(F.decoder(S.BROKER_BACKEND)(raw_map(fields + [("kind", "hb")])), P.decode(P.encode("hb")))


def test_non_str_keys_go_to_the_slow_path():
    fields = list({**BASE["done"], "v": 1, "kind": "done"}.items())
    for key in (1, b"seq", None, True, 1.5):
        assert not typed_path("done", raw_map(fields + [(key, 1)]))
    assert not typed_path("done", raw_map([(k.encode() if k == "seq" else k, v) for k, v in fields]))


def test_trailing_bytes_and_truncation_are_malformed():
    frame = frame_of("done", BASE["done"])
    for bad in (frame + b"\x00", frame[:-1], b"", frame[:1]):
        for kinds in decoders_of("done"):
            with pytest.raises(P.ProtocolError) as info:
                F.decoder(kinds)(bad)
            assert info.value.code == "malformed"


def test_a_map16_header_is_read_by_the_slow_path():
    fields = list({**BASE["done"], "v": 1, "kind": "done"}.items())
    frame = b"\xde" + struct.pack(">H", len(fields)) + raw_map(fields)[1:]
    assert not typed_path("done", frame)
    assert F.decoder(("done",))(frame).seq == 1


# --- a message that narrows its socket's kinds (docs/protocol.md §10.3) ----------------------


@pytest.mark.parametrize(
    "socket, only", [(S.BROKER_BACKEND, S.BATCHED_DONE), (S.RANK_DEALER, S.TASK_HEADER)], ids=["backend", "dealer"]
)
def test_a_narrowed_decoder_refuses_the_sockets_other_kinds_as_protocol_decode_does(socket, only):
    for kind in socket:
        frames = [frame_of(kind, BASE[kind])]
        if "layout" in BASE[kind]:  # a ready or welcome with a bad layout: unknown_kind there, not a layout error
            frames.append(frame_of(kind, BASE[kind], layout={"layers": 0}))
        for frame in frames:
            assert check_agrees(socket, frame, only) == (kind in only and frame == frames[0])
            if kind not in only:
                with pytest.raises(P.ProtocolError) as info:
                    counted(socket).decode(frame, only)
                assert info.value.code == "unknown_kind" and not isinstance(info.value, P.LayoutError)


# --- bounds and enums ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["submit", "task"])
def test_reply_key_is_a_z85_key(kind):
    assert typed_path(kind, frame_of(kind, BASE[kind], reply_key=Z85_KEY))
    for bad in (
        Z85_KEY + "\n",
        Z85_KEY[:-1] + "\n",
        Z85_KEY[:-1],
        Z85_KEY + "a",
        Z85_KEY[:-1] + "~",
        Z85_KEY[:-1] + "é",
        "",
        b"x" * 40,
    ):
        assert not typed_path(kind, frame_of(kind, BASE[kind], reply_key=bad))


STR_FIELDS = [(k, n) for k in KINDS for n, t in {**P.SCHEMAS[k][0], **P.SCHEMAS[k][1]}.items() if t == "str"]


@pytest.mark.parametrize("kind, name", STR_FIELDS, ids=[f"{k}.{n}" for k, n in STR_FIELDS])
def test_strings_are_bounded_in_characters(kind, name):
    if (kind, name) in P.ENUMS or name == "reply_key":
        return  # a word of its enum, a key: below
    most = bounds.STR_MAX.get(name, P.MAX_STR)
    small = {"stats": _DROP} if "stats" in BASE[kind] else {}  # a frame that long sends a stats map the slow way
    assert typed_path(kind, frame_of(kind, BASE[kind], **{name: "\U0001f600" * most, **small}))
    assert not typed_path(kind, frame_of(kind, BASE[kind], **{name: "x" * (most + 1)}))
    assert not typed_path(kind, frame_of(kind, BASE[kind], **{name: b"x"}))


def test_bad_utf8_and_surrogates_in_a_str_field_are_malformed():
    frame = frame_of("result", BASE["result"], reason="abc")
    for raw in (b"\xa1\xff", b"\xa3\xed\xa0\x80", b"\xa2\xc0\x80"):  # bad byte, a UTF-8 surrogate, overlong NUL
        bad = frame.replace(b"\xa3abc", raw)
        with pytest.raises(P.ProtocolError) as info:
            F.decoder(S.CLIENT_PULL)(bad)
        assert info.value.code == "malformed"


ENUM_FIELDS = sorted(P.ENUMS)


@pytest.mark.parametrize("kind, name", ENUM_FIELDS, ids=[f"{k}.{n}" for k, n in ENUM_FIELDS])
def test_enums_come_from_the_tables(kind, name):
    for word in P.ENUMS[kind, name]:
        assert typed_path(kind, frame_of(kind, BASE[kind], **{name: word}))
    every = {w for words in P.ENUMS.values() for w in words} | {"", "OK", "run "}
    for word in sorted(every - set(P.ENUMS[kind, name])):
        assert not typed_path(kind, frame_of(kind, BASE[kind], **{name: word}))


def test_bounds_come_from_the_tables():
    assert not typed_path("done", frame_of("done", BASE["done"], gen=bounds.MAX_GEN + 1))
    assert typed_path("done", frame_of("done", BASE["done"], gen=bounds.MAX_GEN))  # a done echoes its task's gen
    assert typed_path("task", frame_of("task", BASE["task"], gen=P.MAX_SAFE_INT))
    assert not typed_path("result", frame_of("result", BASE["result"], world=0))
    assert not typed_path("result", frame_of("result", BASE["result"], rank=bounds.MAX_WORLD))
    assert typed_path("result", frame_of("result", BASE["result"], rank=bounds.MAX_WORLD - 1, world=bounds.MAX_WORLD))
    assert not typed_path("submit", frame_of("submit", BASE["submit"], timeout_ms=bounds.MAX_TIMEOUT_MS + 1))
    assert not typed_path("done", frame_of("done", BASE["done"], bytes=bounds.MAX_BYTES + 1))
    assert not typed_path("welcome", frame_of("welcome", BASE["welcome"], heartbeat_ms=0))
    assert not typed_path("status", frame_of("status", BASE["status"], wait_ranks=bounds.MAX_WORLD + 1))
    assert typed_path("ready", frame_of("ready", BASE["ready"], pid=bounds.MAX_PID))
    assert not typed_path("ready", frame_of("ready", BASE["ready"], pid=bounds.MAX_PID + 1))
    assert not typed_path("control", frame_of("control", BASE["control"], upto=[0] * (bounds.MAX_WORLD + 1)))


def test_kept_tiers_are_names_of_one_to_sixteen_characters():
    most = bounds.MAX_TIER_NAME
    for good in ([], ["cpu"], ["x" * most, "y"], ["z"] * bounds.LIST_MAX["kept_tiers"], ["\U0001f600" * most]):
        assert typed_path("ready", frame_of("ready", BASE["ready"], kept_tiers=good))
    for bad in ([""], ["x" * (most + 1)], [b"cpu"], [1], "cpu", ["z"] * (bounds.LIST_MAX["kept_tiers"] + 1), [None]):
        assert not typed_path("ready", frame_of("ready", BASE["ready"], kept_tiers=bad))


@pytest.mark.parametrize("kind", ["ready", "welcome", "ack", "control", "resume"])
def test_a_layout_is_typed_as_protocol_decode_types_it(kind):
    for bad in ({"layers": 0}, {"dtype": "int4"}):  # a resume's changes are checked when merged, not read
        assert typed_path(kind, frame_of(kind, BASE[kind], layout=bad)) == (kind == "resume")
    for bad in ({"layers": True}, {"zz": 1}, {1: 2}, [], {"layers": 1.0}, {"layers": "2"}):
        assert not typed_path(kind, frame_of(kind, BASE[kind], layout=bad))
    assert typed_path(kind, frame_of(kind, BASE[kind], layout={}))


def test_digests():
    assert typed_path("result", frame_of("result", BASE["result"], digests=[]))
    for bad in ([b"\x01" * 15], [b"\x01" * 17], ["x" * 16], [1], b"\x01" * 16):
        assert not typed_path("result", frame_of("result", BASE["result"], digests=bad))


def test_checksum_over_the_digest_bound_is_too_large():
    frame = frame_of("result", BASE["result"], digests=[b"\x00" * 16] * (P.MAX_CHECKSUM_IDS + 1))
    with pytest.raises(P.ProtocolError) as info:
        F.decoder(S.CLIENT_PULL)(frame)
    assert info.value.code == "too_large"


def test_frame_over_the_cap_is_too_large():
    frame = frame_of("result", BASE["result"], reason="x" * 100)
    frame = frame.replace(
        b"\xd9\x64" + b"x" * 100, b"\xdb" + struct.pack(">I", P.MAX_FRAME_BYTES) + b"x" * P.MAX_FRAME_BYTES
    )
    with pytest.raises(P.ProtocolError) as info:
        F.decoder(S.CLIENT_PULL)(frame)
    assert info.value.code == "too_large"


def test_body_over_the_cap_is_too_large_before_its_ids_are_read():
    frame = frame_of("body", BASE["body"], src=b"\x00" * (P.MAX_FRAME_BYTES + 4))
    assert not check_agrees(("body",), frame)
    with pytest.raises(P.ProtocolError) as info:
        F.decode_body(frame)
    assert info.value.code == "too_large" and "frame of" in info.value.reason


@pytest.mark.parametrize("src", [P.pack_ids([1, 2]), [1, 2], [2**31 - 1, -(2**31)], b"", [], None])
def test_body_ids_packed_or_as_lists(src):
    frame = frame_of("body", BASE["body"], src=src, dst=src)
    assert check_agrees(("body",), frame)


@pytest.mark.parametrize(
    "src", [b"\x01\x00\x00", [2**31], [True, 1], [1.0, 2.0], ["1", "2"], "1,2", [[1], [2]], [None, None], 5]
)
def test_bad_body_ids_get_the_slow_paths_error(src):
    frame = frame_of("body", BASE["body"], src=src, dst=[1, 2])
    check_agrees(("body",), frame)
    with pytest.raises(P.ProtocolError):
        F.decode_body(frame)


def test_body_checks_after_decoding_are_the_slow_paths():
    for changes in (
        {"op": "swap_sideways"},
        {"tier": ""},
        {"tier": "nvme"},
        {"dst": P.pack_ids([1])},
        {"src": None, "dst": None},
        {"op": "checksum", "src": None},
        {"op": "fill", "dst": b""},
        {"seed": -1},
        {"seed": 2**53},
    ):
        frame = frame_of("body", BASE["body"], **changes)
        check_agrees(("body",), frame)
        assert outcome(F.decode_body, frame) == outcome(P.decode_body, frame)


# --- the property: generated and mutated maps --------------------------------------------

BOUNDARY = [
    0,
    1,
    -1,
    255,
    256,
    2**31 - 1,
    2**31,
    2**40 - 1,
    2**40,
    2**44 - 1,
    2**44,
    3_600_000,
    3_600_001,
    2**53 - 1,
    2**53,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    True,
    False,
    1.0,
    0.0,
    None,
    "",
    "ok",
    "failed",
    "cancelled",
    "gpu",
    "cpu",
    "swap_out",
    "fill",
    "checksum",
    "x" * P.MAX_STR,
    "x" * (P.MAX_STR + 1),
    "é" * P.MAX_STR,
    "x" * 255,  # a host name's bound
    "x" * 256,
    "run",
    "pause",
    ["cpu", "disk"],
    ["x" * 16],  # a tier name's bound
    ["x" * 17],
    [""],
    2**32 - 1,  # a pid's
    2**32,
    REPLY_TO,
    "inproc://x",
    Z85_KEY,
    Z85_KEY + "\n",
    b"",
    b"\x00" * 16,
    b"\x01\x00\x00\x00",
    b"\x01\x00\x00",
    [],
    [1],
    [2**31],
    [True],
    [b"\x00" * 16],
    [b"\x00" * 15],
    {"a": 1},
    {1: 2},
    {"a": {"b": {"c": {}}}},
    {"a": {"b": {"c": {"d": {}}}}},  # an empty map at the deepest level a map field allows
    {"a": {"b": {"c": {"d": {"e": 1}}}}},  # one level deeper than that
    {"a": [[[1]]]},
    {"n": list(range(bounds.MAX_NEST_ITEMS))},  # one entry over the field's budget (the map's own counts)
    {"n": list(range(bounds.MAX_NEST_ITEMS - 1))},
    {"s": "x" * bounds.MAX_STR, "t": "y" * bounds.MAX_STR, "u": "z" * bounds.MAX_STR},  # a large stats map
    {"i": bounds.MAX_SAFE_INT, "j": -bounds.MAX_SAFE_INT - 1, "f": 1.5, "b": b"\x00"},
    [[[]]],
    list(range(bounds.LIST_MAX["upto"] + 1)),  # an upto of more ranks than a world may have
    msgpack.ExtType(1, b"x"),
]
_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**54), 2**54), st.floats(), st.text(max_size=4), st.binary(max_size=2)
)
nested = st.recursive(
    _scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
)
value = st.one_of(
    nested,
    st.sampled_from(BOUNDARY),
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=8),
    st.binary(max_size=20),
    st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=4),
)
FIELD_NAMES = sorted({n for k in KINDS for n in (*P.SCHEMAS[k][0], *P.SCHEMAS[k][1])})
key = st.one_of(
    st.sampled_from(["v", "kind", "zz", *FIELD_NAMES]),
    st.text(max_size=4),
    st.integers(-(2**63), 2**64 - 1),
    st.none(),
    st.binary(max_size=4),
)


@st.composite
def mutated(draw):
    """A frame of any kind: valid, then changed a few times, written entry
    by entry so keys may repeat."""
    kind = draw(st.sampled_from(KINDS))
    fields = draw(_message(kind)) if kind != "body" else dict(BASE["body"])
    pairs = [*fields.items(), ("v", 1), ("kind", kind)]
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.sampled_from(["set", "drop", "add", "repeat", "swap_kind"]))
        if how == "set" and pairs:
            i = draw(st.integers(0, len(pairs) - 1))
            pairs[i] = (pairs[i][0], draw(value))
        elif how == "drop" and pairs:
            pairs.pop(draw(st.integers(0, len(pairs) - 1)))
        elif how == "add":
            pairs.insert(draw(st.integers(0, len(pairs))), (draw(key), draw(value)))
        elif how == "repeat" and pairs:
            pairs.insert(draw(st.integers(0, len(pairs))), (draw(st.sampled_from(pairs))[0], draw(value)))
        elif how == "swap_kind":
            pairs.insert(draw(st.integers(0, len(pairs))), ("kind", draw(st.sampled_from([*KINDS, "launch"]))))
    frame = raw_map(pairs)
    if draw(st.integers(0, 9)) == 0:  # sometimes a byte changed or cut off
        i = draw(st.integers(0, len(frame) - 1))
        frame = frame[:i] + bytes([draw(st.integers(0, 255))]) + frame[i + 1 :] if draw(st.booleans()) else frame[:i]
    return kind, frame


NARROWED = {S.BROKER_BACKEND: S.BATCHED_DONE, S.RANK_DEALER: S.TASK_HEADER}


@pytest.mark.timeout(1800 if LONG else 120)
@settings(max_examples=20_000 if LONG else 400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.data())
def test_typed_accept_is_slow_accept_and_typed_refuse_is_slow_error(case, data):
    kind, frame = case
    # the kind's own decoder, a socket's that receives it, every kind's; or any socket's
    kinds = data.draw(st.sampled_from([*decoders_of(kind), *S.SOCKETS.values()]))
    only = data.draw(st.sampled_from([None, NARROWED[kinds]])) if kinds in NARROWED else None
    check_agrees(kinds, frame, only)


# --- encoders: a message built and to_wire()-d --------------------------------------------


def encode(kind, fields):
    """The frame zkv sends for these fields: its typed message, encoded."""
    cls = MESSAGES[kind]
    names = set(wire_fields(cls))
    if kind == "reply":
        known = {k: v for k, v in fields.items() if k in names}
        return cls(**known, extra={k: v for k, v in fields.items() if k not in names}).to_wire()
    return cls(**fields).to_wire()


def _buildable(vec):
    """A valid vector of a kind's own fields (one has a field no schema names: no message holds it)."""
    if "fields" not in vec:
        return False
    names = set(wire_fields(MESSAGES[vec["kind"]]))
    return vec["kind"] == "reply" or set(vec["fields"]) <= names


@pytest.mark.parametrize("vec", [v for v in VALID if _buildable(v)], ids=lambda v: v["name"])
def test_a_message_reproduces_the_golden_bytes(vec):
    assert encode(vec["kind"], from_json(vec["fields"])).hex() == vec["hex"]


def test_every_kind_has_a_buildable_golden_vector():
    assert {v["kind"] for v in VALID if _buildable(v)} >= set(MESSAGES) - {"body"}


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_round_trips_through_protocol_decode(kind):
    @settings(max_examples=200 if LONG else 25, deadline=None)
    @given(_message(kind))
    def check(fields):
        known = {k: fields[k] for k in wire_fields(MESSAGES[kind]) if k in fields}
        frame = encode(kind, known)
        assert frame == P.encode(kind, **known)
        assert same(P.decode(frame, (kind,)), P.message({**known, "kind": kind}))  # its words as their members
        if known.get("layout") is not None:  # a message holds its layout typed
            known["layout"] = P.LAYOUT_TYPES[kind].from_wire(known["layout"])
        assert P.decode(frame, (kind,)) == MESSAGES[kind](**known)
        assert typed_path(kind, frame)

    check()


@pytest.mark.parametrize("kind", KINDS)
def test_absent_optionals_are_left_out_never_nil(kind):
    required = {k: v for k, v in BASE[kind].items() if k in P.SCHEMAS[kind][0]}
    msg = msgpack.unpackb(encode(kind, required), raw=False)
    assert set(msg) == {*required, "v", "kind"} and None not in msg.values()
    nils = dict.fromkeys(P.SCHEMAS[kind][1])
    assert encode(kind, {**required, **nils}) == encode(kind, required)


def test_a_name_of_the_weights_is_one_line_of_text():
    assert typed_path("clear", frame_of("clear", BASE["clear"], weights="step-1 (run 7)"))
    for bad in ("", "a\nb", "\x7f", "x" * 257):
        assert not typed_path("clear", frame_of("clear", BASE["clear"], weights=bad))
