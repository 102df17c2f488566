"""The typed fast path of the hot kinds (zkv/wire/fast.py) against the
validating codec: what the fast path accepts, ``protocol.decode`` accepts
with the same message (same class, fields, values *and types*: ``True == 1``
in Python, so every comparison here is type-strict); what it does not take
ends in ``protocol.decode``'s own ProtocolError, code and reason.

Checked on every golden vector of a hot kind, on each msgspec behaviour that
could differ from msgpack's (bool or float for an int, nil, extra fields,
duplicate keys, non-str keys, long strings, trailing bytes, ids), and by a
hypothesis property over generated and mutated maps.  ``ZKV_LONG_FUZZ=1``
runs the property long.
"""

from __future__ import annotations

import enum
import os
import struct

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_protocol import INVALID, VALID, _message, from_json

from zkv.wire import bounds
from zkv.wire import fast as F
from zkv.wire import protocol as P
from zkv.wire.messages import MESSAGES, Message, wire_fields

LONG = os.environ.get("ZKV_LONG_FUZZ") == "1"
HOT = ("submit", "task", "done", "result")
Z85_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
REPLY_TO = "tcp://127.0.0.1:5555"
BASE = {  # one valid map of each hot kind, every optional field present
    "submit": {"task": 1, "reply_to": REPLY_TO, "timeout_ms": 5000, "reply_key": Z85_KEY, "batch_results": True},
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
    "done": {"seq": 1, "n": 1, "outcome": "ok", "gen": 1, "bytes": 4096},
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
    },
    "body": {"op": "swap_out", "src": P.pack_ids([1, 2]), "dst": P.pack_ids([3, 4]), "tier": "gpu", "seed": 0},
    "ack": {
        "epoch": 3,
        "op": "resume",
        "gen": 2,
        "upto": 9,
        "freed": 4096,
        "layout": {"layers": 2, "gpu_blocks": 64},
        "cpu_kept": True,
        "stats": {"tasks_ok": 7, "device": "cpu", "copy_seconds": 0.25, "cpu_tier": {"rows": [1, {"k": []}]}},
        "error": "",
    },
    "control": {"epoch": 4, "op": "resume", "gen": 3, "upto": [7, 0], "keep_cpu": False, "layout": {"gpu_blocks": 32}},
    "hb": {"inflight": 2, "stats": {"tasks_ok": 7, "op": "run", "x": None, "ok": False}, "probe": True},
}


def same(a, b) -> bool:
    """Equal and of the same types all the way down (``True == 1`` is not enough)."""
    if isinstance(a, Message) and isinstance(b, Message):  # the fast path's class is a subclass of the kind's
        cls = MESSAGES[a.kind]
        return (
            isinstance(a, cls)
            and isinstance(b, cls)
            and all(same(getattr(a, n), getattr(b, n)) for n in cls.__struct_fields__)
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
    """A decoder of ``hot`` whose slow path counts: was the fast path enough?"""

    def __init__(self, hot, kinds=None):
        self.fallbacks = 0
        self.kinds = kinds
        self.decode = F.decoder(hot, kinds, slow=self._slow)

    def _slow(self, frame, kinds):
        self.fallbacks += 1
        return P.decode(frame, kinds)


def check_agrees(hot, frame, kinds=None) -> bool:
    """The fast decoder and protocol.decode agree on ``frame``; True when the
    fast path alone took it."""
    counted = Counted(hot, kinds)
    fast = outcome(counted.decode, frame)
    slow = outcome(P.decode, frame, kinds)
    assert fast[0] == slow[0], (fast, slow)
    assert same(fast[1], slow[1]), (fast, slow)
    if hot == "body":
        assert outcome(F.decode_body, frame) == outcome(P.decode_body, frame)
    return counted.fallbacks == 0


def frame_of(kind, fields, **changes):
    msg = {**fields, "v": 1, "kind": kind, **changes}
    return msgpack.packb({k: v for k, v in msg.items() if v is not _DROP}, use_bin_type=True)


_DROP = object()


def raw_map(pairs) -> bytes:
    """A map written entry by entry: keys may repeat, or be of any type."""
    head = bytes([0x80 + len(pairs)]) if len(pairs) < 16 else b"\xde" + struct.pack(">H", len(pairs))
    return head + b"".join(msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True) for k, v in pairs)


# --- the tables ------------------------------------------------------------------------


def test_every_hot_kind_has_a_type_from_the_schema():
    for kind in F.HOT_KINDS:
        required, optional = P.SCHEMAS[kind]
        fields = {f.name: f for f in msgspec.structs.fields(F.TYPES[kind])}
        assert F.TYPES[kind].__struct_config__.tag == kind and not issubclass(F.TYPES[kind], MESSAGES[kind])
        assert list(fields) == [*wire_fields(MESSAGES[kind]), "v"]
        assert {n for n, f in fields.items() if f.required} == {"v", *required}


def test_a_decoder_is_made_only_for_a_hot_kind_on_a_socket_that_takes_it():
    with pytest.raises(ValueError):
        F.decoder("pause")
    with pytest.raises(ValueError):
        F.decoder("submit", ("ready", "done"))


# --- golden vectors ------------------------------------------------------------------------


HOT_VALID = [v for v in VALID if v["kind"] in F.HOT_KINDS]
DECODE_INVALID = [v for v in INVALID if v["decoder"] in ("decode", "decode_body")]


@pytest.mark.parametrize("vec", HOT_VALID, ids=[v["name"] for v in HOT_VALID])
def test_valid_vector_takes_the_fast_path_to_the_same_map(vec):
    frame = bytes.fromhex(vec["hex"])
    assert check_agrees(vec["kind"], frame), "a golden vector of a hot kind fell back to the slow path"
    msg = F.decoder(vec["kind"])(frame)
    read = {k: v.value if isinstance(v, enum.Enum) else v for k, v in msg.to_dict().items()}  # the words as sent
    read, decoded = {**read, "v": 1, "kind": msg.kind}, from_json(vec["decoded"])
    assert same(dict(sorted(read.items())), dict(sorted(decoded.items())))
    if vec["kind"] == "body":
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
    kinds = vec["expect_kinds"]
    for hot in F.HOT_KINDS:
        if kinds is None or hot in kinds:
            counted = Counted(hot, kinds)
            with pytest.raises(P.ProtocolError) as info:
                counted.decode(frame)
            assert info.value.code == vec["code"]
            assert counted.fallbacks == 1
            assert outcome(counted.decode, frame) == outcome(P.decode, frame, kinds)


# --- what msgspec reads differently from msgpack ---------------------------------------


@pytest.mark.parametrize("kind", F.HOT_KINDS)
def test_full_map_takes_the_fast_path(kind):
    assert check_agrees(kind, frame_of(kind, BASE[kind]))


@pytest.mark.parametrize("value", [True, False, 1.0, 0.0, -1, 2**53, 2**64 - 1, "1", b"\x01", None, [1], {"a": 1}])
@pytest.mark.parametrize("kind", HOT)
def test_an_integer_field_takes_only_an_int(kind, value):
    name = next(n for n, t in P.SCHEMAS[kind][0].items() if t == "uint")
    assert not check_agrees(kind, frame_of(kind, BASE[kind], **{name: value}))


@pytest.mark.parametrize("v", [True, 1.0, 2, 0, "1", None, _DROP])
def test_version_is_exactly_the_int_1(v):
    frame = (
        frame_of("done", BASE["done"], v=v)
        if v is not _DROP
        else raw_map([(k, x) for k, x in {**BASE["done"], "kind": "done"}.items()])
    )
    assert not check_agrees("done", frame)
    with pytest.raises(P.ProtocolError) as info:
        F.decoder("done")(frame)
    assert info.value.code == "bad_version"


def test_version_as_a_wide_int_is_still_1():
    frame = frame_of("done", BASE["done"])
    wide = frame.replace(b"\xa1v\x01", b"\xa1v\xcf" + (1).to_bytes(8, "big"))  # uint64 1
    assert wide != frame and msgpack.unpackb(wide)["v"] == 1
    assert check_agrees("done", wide)
    assert not check_agrees("done", frame.replace(b"\xa1v\x01", b"\xa1v\xd4\x00\x01"))  # an ext is not an int


@pytest.mark.parametrize("kind", HOT)
def test_nil_optional_reads_as_absent_as_the_slow_path_has_it(kind):
    for name in P.SCHEMAS[kind][1]:
        frame = frame_of(kind, BASE[kind], **{name: None})
        assert check_agrees(kind, frame)
        assert getattr(F.decoder(kind)(frame), name) is None


@pytest.mark.parametrize("kind", HOT)
def test_absent_optionals(kind):
    required = {k: v for k, v in BASE[kind].items() if k in P.SCHEMAS[kind][0]}
    assert check_agrees(kind, frame_of(kind, required))


@pytest.mark.parametrize("kind", HOT)
def test_missing_required_field_is_the_slow_paths_error(kind):
    for name in P.SCHEMAS[kind][0]:
        assert not check_agrees(kind, frame_of(kind, BASE[kind], **{name: _DROP}))


@pytest.mark.parametrize(
    "extra",
    [1, "x", None, {"a": [1, 2]}, {1: 2}, [[]], msgpack.ExtType(5, b"x"), msgpack.Timestamp(1, 0), 2**64 - 1, -(2**63)],
)
@pytest.mark.parametrize("kind", HOT)
def test_unknown_field_goes_to_the_slow_path_which_ignores_it(kind, extra):
    assert not check_agrees(kind, frame_of(kind, BASE[kind], zz_extra=extra))
    assert same(
        F.decoder(kind)(frame_of(kind, BASE[kind], zz_extra=extra)), F.decoder(kind)(frame_of(kind, BASE[kind]))
    )


def test_unknown_field_whose_value_msgpack_refuses_is_refused():
    # msgspec skips an unknown field without looking: a map key msgpack cannot
    # hash, or bad UTF-8, would pass it; the slow path names the frame malformed.
    good = frame_of("done", BASE["done"])
    bad_utf8 = bytes([good[0] + 1]) + good[1:] + msgpack.packb("zz") + b"\xa1\xff"
    unhashable = bytes([good[0] + 1]) + good[1:] + msgpack.packb("zz") + b"\x81\x80\x01"  # {{}: 1}
    for frame in (bad_utf8, unhashable):
        with pytest.raises(P.ProtocolError) as info:
            F.decoder("done")(frame)
        assert info.value.code == "malformed"


def test_map_wider_than_the_slow_paths_bound_is_refused():
    pairs = [("v", 1), ("kind", "done")] + [("seq", 1)] * 4100 + [(k, v) for k, v in BASE["done"].items()]
    frame = b"\xdf" + struct.pack(">I", len(pairs)) + raw_map(pairs)[3:]
    with pytest.raises(P.ProtocolError) as info:
        F.decoder("done")(frame)
    assert info.value.code == "malformed"


def test_duplicate_keys_read_as_msgpack_reads_them():
    fields = list({**BASE["done"], "v": 1, "kind": "done"}.items())
    fast = [  # msgspec reads a repeated key as msgpack does: the last one wins
        fields + [("seq", 2)],
        fields + [("bytes", None)],
        [("bytes", None)] + fields,
    ]
    slow = [
        fields + [("seq", True)],  # a bad last one: refused
        [("seq", True)] + fields,  # a bad first one: the last wins
        fields + [("kind", "hb")],  # now a heartbeat
        [("kind", "hb")] + fields,
        fields + [("v", 2)],
        [("v", 2)] + fields,
    ]
    for pairs in fast:
        assert check_agrees("done", raw_map(pairs))
    for pairs in slow:
        assert not check_agrees("done", raw_map(pairs))
    assert F.decoder("done")(raw_map(fields + [("seq", 2)])).seq == 2
    assert F.decoder("done")(raw_map(fields + [("bytes", None)])).bytes is None
    assert same(
        F.decoder("done", ("ready", "hb", "done", "ack"))(raw_map(fields + [("kind", "hb")])), P.decode(P.encode("hb"))
    )


def test_non_str_keys_go_to_the_slow_path():
    fields = list({**BASE["done"], "v": 1, "kind": "done"}.items())
    for key in (1, b"seq", None, True, 1.5):
        assert not check_agrees("done", raw_map(fields + [(key, 1)]))
    assert not check_agrees("done", raw_map([(k.encode() if k == "seq" else k, v) for k, v in fields]))


def test_trailing_bytes_and_truncation_are_malformed():
    frame = frame_of("done", BASE["done"])
    for bad in (frame + b"\x00", frame[:-1], b"", frame[:1]):
        with pytest.raises(P.ProtocolError) as info:
            F.decoder("done")(bad)
        assert info.value.code == "malformed"


def test_a_map16_header_is_read_by_the_slow_path():
    fields = list({**BASE["done"], "v": 1, "kind": "done"}.items())
    frame = b"\xde" + struct.pack(">H", len(fields)) + raw_map(fields)[1:]
    assert not check_agrees("done", frame)
    assert F.decoder("done")(frame).seq == 1


@pytest.mark.parametrize("kind", ["submit", "task"])
def test_reply_key_is_a_z85_key(kind):
    assert check_agrees(kind, frame_of(kind, BASE[kind], reply_key=Z85_KEY))
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
        assert not check_agrees(kind, frame_of(kind, BASE[kind], reply_key=bad))


def test_strings_are_bounded_in_characters():
    for kind in ("submit", "task", "result"):
        name = "reason" if kind == "result" else "reply_to"
        assert check_agrees(kind, frame_of(kind, BASE[kind], **{name: "\U0001f600" * P.MAX_STR}))
        assert not check_agrees(kind, frame_of(kind, BASE[kind], **{name: "x" * (P.MAX_STR + 1)}))
        assert not check_agrees(kind, frame_of(kind, BASE[kind], **{name: b"x"}))


def test_bad_utf8_and_surrogates_in_a_str_field_are_malformed():
    frame = frame_of("result", BASE["result"], reason="abc")
    for raw in (b"\xa1\xff", b"\xa3\xed\xa0\x80", b"\xa2\xc0\x80"):  # bad byte, a UTF-8 surrogate, overlong NUL
        bad = frame.replace(b"\xa3abc", raw)
        with pytest.raises(P.ProtocolError) as info:
            F.decoder("result")(bad)
        assert info.value.code == "malformed"


def test_enums_and_bounds_come_from_the_tables():
    assert not check_agrees("done", frame_of("done", BASE["done"], outcome="cancelled"))
    assert not check_agrees("done", frame_of("done", BASE["done"], gen=bounds.MAX_GEN + 1))
    assert check_agrees("done", frame_of("done", BASE["done"], gen=bounds.MAX_GEN))  # a done echoes its task's gen
    assert check_agrees("task", frame_of("task", BASE["task"], gen=P.MAX_SAFE_INT))
    assert not check_agrees("result", frame_of("result", BASE["result"], world=0))
    assert not check_agrees("result", frame_of("result", BASE["result"], rank=bounds.MAX_WORLD))
    assert check_agrees("result", frame_of("result", BASE["result"], rank=bounds.MAX_WORLD - 1, world=bounds.MAX_WORLD))
    assert not check_agrees("submit", frame_of("submit", BASE["submit"], timeout_ms=bounds.MAX_TIMEOUT_MS + 1))
    assert not check_agrees("done", frame_of("done", BASE["done"], bytes=bounds.MAX_BYTES + 1))


def test_digests():
    assert check_agrees("result", frame_of("result", BASE["result"], digests=[]))
    for bad in ([b"\x01" * 15], [b"\x01" * 17], ["x" * 16], [1], b"\x01" * 16):
        assert not check_agrees("result", frame_of("result", BASE["result"], digests=bad))


def test_checksum_over_the_digest_bound_is_too_large():
    frame = frame_of("result", BASE["result"], digests=[b"\x00" * 16] * (P.MAX_CHECKSUM_IDS + 1))
    with pytest.raises(P.ProtocolError) as info:
        F.decoder("result")(frame)
    assert info.value.code == "too_large"


def test_frame_over_the_cap_is_too_large():
    frame = frame_of("result", BASE["result"], reason="x" * 100)
    frame = frame.replace(
        b"\xd9\x64" + b"x" * 100, b"\xdb" + struct.pack(">I", P.MAX_FRAME_BYTES) + b"x" * P.MAX_FRAME_BYTES
    )
    with pytest.raises(P.ProtocolError) as info:
        F.decoder("result")(frame)
    assert info.value.code == "too_large"


def test_body_over_the_cap_is_too_large_before_its_ids_are_read():
    frame = frame_of("body", BASE["body"], src=b"\x00" * (P.MAX_FRAME_BYTES + 4))
    assert not check_agrees("body", frame)
    with pytest.raises(P.ProtocolError) as info:
        F.decode_body(frame)
    assert info.value.code == "too_large" and "frame of" in info.value.reason


@pytest.mark.parametrize("src", [P.pack_ids([1, 2]), [1, 2], [2**31 - 1, -(2**31)], b"", [], None])
def test_body_ids_packed_or_as_lists(src):
    frame = frame_of("body", BASE["body"], src=src, dst=src)
    assert check_agrees("body", frame)


@pytest.mark.parametrize(
    "src", [b"\x01\x00\x00", [2**31], [True, 1], [1.0, 2.0], ["1", "2"], "1,2", [[1], [2]], [None, None], 5]
)
def test_bad_body_ids_get_the_slow_paths_error(src):
    frame = frame_of("body", BASE["body"], src=src, dst=[1, 2])
    check_agrees("body", frame)
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
        check_agrees("body", frame)
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
key = st.one_of(
    st.sampled_from(
        ["v", "kind", "seq", "n", "task", "gen", "bytes", "reply_to", "reply_key", "outcome", "src", "tier", "zz"]
        + ["stats", "layout", "op", "epoch", "inflight", "upto", "keep_cpu"]
    ),
    st.text(max_size=4),
    st.integers(-(2**63), 2**64 - 1),
    st.none(),
    st.binary(max_size=4),
)


@st.composite
def mutated(draw):
    """A frame of a hot kind: valid, then changed a few times, written entry
    by entry so keys may repeat."""
    kind = draw(st.sampled_from(F.HOT_KINDS))
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
            kinds = ["submit", "task", "done", "result", "body", "hb", "ack", "control", "ping"]
            pairs.append(("kind", draw(st.sampled_from(kinds))))
    frame = raw_map(pairs)
    if draw(st.integers(0, 9)) == 0:  # sometimes a byte changed or cut off
        i = draw(st.integers(0, len(frame) - 1))
        frame = frame[:i] + bytes([draw(st.integers(0, 255))]) + frame[i + 1 :] if draw(st.booleans()) else frame[:i]
    return kind, frame


@pytest.mark.timeout(1800 if LONG else 120)
@settings(max_examples=20_000 if LONG else 600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.sampled_from([None, "socket"]))
def test_fast_accept_is_slow_accept_and_fast_refuse_is_slow_error(case, where):
    kind, frame = case
    kinds = (
        {
            "submit": ("submit", "pause", "clear", "resume", "status", "ping"),
            "done": ("ready", "hb", "done", "ack"),
            "task": ("task",),
            "result": None,
            "body": ("body",),
            "ack": ("ready", "hb", "done", "ack"),
            "hb": ("ready", "hb", "done", "ack"),
            "control": ("control",),
        }[kind]
        if where
        else None
    )
    # on the broker's rank socket, one decoder takes the three hot kinds a rank sends
    hot = ("done", "ack", "hb") if where and kind in ("done", "ack", "hb") else kind
    check_agrees(hot, frame, kinds)


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


@pytest.mark.parametrize("kind", HOT)
def test_encoder_round_trips_through_protocol_decode(kind):
    @settings(max_examples=200 if LONG else 40, deadline=None)
    @given(_message(kind))
    def check(fields):
        known = {k: fields[k] for k in wire_fields(MESSAGES[kind]) if k in fields}
        frame = encode(kind, known)
        assert frame == P.encode(kind, **known)
        assert same(P.decode(frame, (kind,)), P.message({**known, "kind": kind}))  # its words as their members
        assert P.decode(frame, (kind,)) == MESSAGES[kind](**known)
        assert check_agrees(kind, frame)

    check()


@pytest.mark.parametrize("kind", HOT)
def test_absent_optionals_are_left_out_never_nil(kind):
    required = {k: v for k, v in BASE[kind].items() if k in P.SCHEMAS[kind][0]}
    msg = msgpack.unpackb(encode(kind, required), raw=False)
    assert set(msg) == {*required, "v", "kind"} and None not in msg.values()
    nils = dict.fromkeys(P.SCHEMAS[kind][1])
    assert encode(kind, {**required, **nils}) == encode(kind, required)
