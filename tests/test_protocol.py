"""The codec against the golden vectors (tests/vectors), plus round trips.

The vectors are the contract shared with clients in other languages
(docs/protocol.md); these tests pin the Python codec to them in both
directions: decoding gives the expected map or error code, and the encoder
reproduces the committed bytes exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
from pathlib import Path

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zkv.wire import bounds
from zkv.wire import messages as M
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout

VECTORS = Path(__file__).parent / "vectors"


def _load(name: str) -> list[dict]:
    data = json.loads((VECTORS / name).read_text())
    assert data["protocol"] == "zkv" and data["version"] == P.VERSION
    return data["vectors"]


def from_json(value):
    """Undo the vectors' JSON convention: {"$bin": hex} is a msgpack bin."""
    if isinstance(value, dict):
        if set(value) == {"$bin"}:
            return bytes.fromhex(value["$bin"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


VALID = _load("valid.json")
INVALID = _load("invalid.json")
MESSAGES = [v for v in VALID if v["kind"] != "body"]
BODIES = [v for v in VALID if v["kind"] == "body"]


def _ids(vectors):
    return [v["name"] for v in vectors]


# --- the vector files themselves ----------------------------------------------------


def test_vector_files_are_what_the_generator_makes():
    spec = importlib.util.spec_from_file_location("make_vectors", VECTORS / "make_vectors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, text in mod.build().items():
        assert (VECTORS / name).read_text() == text, f"{name} is stale: run python tests/vectors/make_vectors.py"


def test_every_kind_has_a_valid_vector():
    assert {v["kind"] for v in VALID} == set(P.SCHEMAS)


def test_every_error_code_of_the_codec_has_an_invalid_vector():
    assert {v["code"] for v in INVALID} >= {"malformed", "bad_version", "unknown_kind", "bad_field"}


def test_names_are_unique():
    for vectors in (VALID, INVALID):
        names = _ids(vectors)
        assert len(names) == len(set(names))


# --- valid vectors --------------------------------------------------------------------


def as_map(msg) -> dict:
    """A decoded message as the map it was read from: its fields, ``v`` and ``kind``."""
    assert isinstance(msg, M.MESSAGES[msg.kind])
    return {**msg.to_dict(), "v": P.VERSION, "kind": msg.kind}


def read(decoded: dict) -> dict:
    """What of a decoded map a message keeps: nil reads as absent, and fields
    no schema names are ignored (but for a reply's, its op's results)."""
    kind = decoded["kind"]
    named = {*P.SCHEMAS[kind][0], *P.SCHEMAS[kind][1], "v", "kind"}
    return {k: v for k, v in decoded.items() if (v is not None and k in named) or (kind == "reply" and k not in named)}


@pytest.mark.parametrize("vec", MESSAGES, ids=_ids(MESSAGES))
def test_valid_message_decodes_to_expected_map(vec):
    msg = P.decode(bytes.fromhex(vec["hex"]))
    assert as_map(msg) == read(from_json(vec["decoded"]))
    assert msg.kind == vec["kind"] and type(msg) is M.MESSAGES[vec["kind"]]


@pytest.mark.parametrize("vec", MESSAGES, ids=_ids(MESSAGES))
def test_encoder_reproduces_valid_message_bytes(vec):
    assert P.encode(vec["kind"], **from_json(vec["fields"])).hex() == vec["hex"]


@pytest.mark.parametrize("vec", BODIES, ids=_ids(BODIES))
def test_valid_body_decodes(vec):
    frame = bytes.fromhex(vec["hex"])
    assert as_map(P.decode(frame, ("body",))) == read(from_json(vec["decoded"]))
    body = P.decode_body(frame)
    expect = vec["body"]
    assert (body.op, body.src, body.dst, body.tier, body.seed) == (
        expect["op"],
        expect["src"],
        expect["dst"],
        expect["tier"],
        expect["seed"],
    )


@pytest.mark.parametrize(
    "vec", [b for b in BODIES if b["encode_body"]], ids=_ids([b for b in BODIES if b["encode_body"]])
)
def test_encode_body_reproduces_packed_bodies(vec):
    enc = vec["encode_body"]
    assert P.encode_body(enc["op"], enc["src"], enc["dst"], **enc["extra"]).hex() == vec["hex"]


def test_python_client_sends_packed_ids():
    """encode_body packs ids as bin (little-endian int32), never as an array."""
    msg = msgpack.unpackb(P.encode_body("swap_out", [3, 4], [10, 11]), raw=False)
    assert msg["src"] == struct.pack("<2i", 3, 4) and msg["dst"] == struct.pack("<2i", 10, 11)


# --- invalid vectors -----------------------------------------------------------------


REPLY_TO_VECTORS = [v for v in INVALID if v["decoder"] == "reply_to"]
CODEC_VECTORS = [v for v in INVALID if v["decoder"] != "reply_to"]


@pytest.mark.parametrize("vec", REPLY_TO_VECTORS, ids=_ids(REPLY_TO_VECTORS))
def test_a_reply_to_that_the_bounds_refuse_decodes_and_its_task_is_rejected(vec):
    """The submit decodes; the broker ends its task ``rejected`` (and a rank never connects)."""
    msg = P.decode(bytes.fromhex(vec["hex"]))
    assert vec["code"] == "rejected" and not P.is_result_address(msg.reply_to), msg.reply_to


@pytest.mark.parametrize("vec", CODEC_VECTORS, ids=_ids(CODEC_VECTORS))
def test_invalid_vector_raises_expected_code(vec):
    frame = bytes.fromhex(vec["hex"])
    with pytest.raises(P.ProtocolError) as info:
        if vec["decoder"] == "decode_body":
            P.decode_body(frame)
        elif vec["decoder"] == "layout":  # the frame decodes; its layout map fails §4.8
            from zkv.wire.layout import CacheLayout

            CacheLayout.from_wire(P.decode(frame).layout)
        else:
            P.decode(frame, vec["expect_kinds"])
    assert info.value.code == vec["code"], info.value.reason
    assert info.value.reason and len(info.value.reason) <= 200, info.value.reason  # what an error reply carries


@pytest.mark.parametrize(
    "frame",
    [
        {"v": 1, "kind": "k" * 5000, "req": 1},
        {"v": "v" * 5000, "kind": "hb"},
        {"v": b"b" * 5000, "kind": "hb"},
        {"v": 1, "kind": "done", "seq": 1, "n": 1, "outcome": "o" * 4096, "gen": 0},
        {"v": 1, "kind": "ping", "req": -(2**63)},
        {"v": 1, "kind": "ping", "req": {f"k{i}": "x" * 4000 for i in range(4)}},
    ],
    ids=["kind", "v_str", "v_bin", "enum", "negative", "map"],
)
def test_an_error_reason_quotes_a_peer_value_cut_to_64_characters(frame):
    with pytest.raises(P.ProtocolError) as info:
        P.decode(msgpack.packb(frame, use_bin_type=True))
    assert len(info.value.reason) <= 128, info.value.reason
    assert P.decode(P.encode("error", code=info.value.code, reason=info.value.reason)).reason == info.value.reason


def test_the_error_vector_shows_the_cut_form():
    (vec,) = [v for v in VALID if v["name"] == "error_echo_cut"]
    reason = vec["decoded"]["reason"]
    assert reason == "unknown message kind '" + "k" * 62 + "\u2026" and len(reason) == 21 + bounds.MAX_ECHO
    assert P.clamp("r" * 5000) == "r" * (P.MAX_STR - 1) + "\u2026"


def test_frame_over_the_cap_is_too_large_before_parsing():
    with pytest.raises(P.ProtocolError) as info:
        P.decode(b"\x00" * (P.MAX_FRAME_BYTES + 1))
    assert info.value.code == "too_large"


def test_frame_at_the_cap_is_parsed():
    pad = P.MAX_FRAME_BYTES - len(P.encode("ping", req=1, pad="")) - 4  # str32 header is 5 bytes, not 1
    frame = P.encode("ping", req=1, pad="x" * pad)
    assert len(frame) <= P.MAX_FRAME_BYTES
    assert P.decode(frame).req == 1


def test_more_ids_than_the_cap_is_too_large():
    with pytest.raises(P.ProtocolError) as info:
        P.unpack_ids(bytes(4 * (P.MAX_IDS + 1)), "src")
    assert info.value.code == "too_large"
    with pytest.raises(P.ProtocolError) as info:
        P.unpack_ids([0] * (P.MAX_IDS + 1), "src")
    assert info.value.code == "too_large"


# --- ids -------------------------------------------------------------------------------


def test_pack_ids_is_little_endian_int32():
    assert P.pack_ids([1, 256, 2**31 - 1]) == bytes.fromhex("0100000000010000ffffff7f")
    assert P.pack_ids([]) == b""


def test_pack_ids_passes_bytes_through():
    raw = struct.pack("<3i", 5, 6, 7)
    assert P.pack_ids(raw) == raw
    assert P.pack_ids(bytearray(raw)) == raw


def test_pack_ids_takes_a_tensor():
    torch = pytest.importorskip("torch")
    assert P.pack_ids(torch.tensor([9, 8, 7], dtype=torch.int64)) == struct.pack("<3i", 9, 8, 7)


def test_pack_ids_refuses_ids_beyond_int32():
    with pytest.raises(OverflowError):
        P.pack_ids([2**31])


def test_unpack_ids_reads_both_forms():
    assert P.unpack_ids(struct.pack("<2i", 3, 4)) == [3, 4]
    assert P.unpack_ids([3, 4]) == [3, 4]
    assert P.unpack_ids(b"") == [] and P.unpack_ids([]) == []


def test_unpack_ids_keeps_negative_packed_ids_for_the_rank_to_reject():
    """The codec checks shape only; ranges belong to the rank (result failed)."""
    assert P.unpack_ids(struct.pack("<i", -1)) == [-1]


@pytest.mark.parametrize("bad", [b"\x00\x00\x00", "abc", 5, None, [1.0], [True]])
def test_unpack_ids_rejects_what_is_not_ids(bad):
    with pytest.raises(P.ProtocolError) as info:
        P.unpack_ids(bad)
    assert info.value.code == "bad_field"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=300))
def test_ids_round_trip(ids):
    packed = P.pack_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert P.unpack_ids(packed) == ids
    assert P.unpack_ids(msgpack.unpackb(msgpack.packb(ids), raw=False)) == ids


# --- round trips -------------------------------------------------------------------

uint = st.integers(min_value=0, max_value=P.MAX_SAFE_INT)
text = st.text(max_size=40)
_STRATEGIES = {
    "uint": uint,
    "str": text,
    "bool": st.booleans(),
    "map": st.dictionaries(st.text(max_size=8), uint, max_size=4),
    "list": st.lists(uint, max_size=4),
    "ids": st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=8),
}


def _field(kind, name, typ):
    """Any value the schema and the documented bounds (protocol §2.1) allow."""
    if typ == "uint":
        lo, hi = P.uint_bounds(kind, name)
        return st.integers(min_value=lo, max_value=hi)
    if (kind, name) in P.ENUMS:
        return st.sampled_from(P.ENUMS[(kind, name)])
    if name == "reply_key":
        return st.text(alphabet=sorted(P._Z85), min_size=40, max_size=40)
    if name == "digests":
        return st.lists(st.binary(min_size=16, max_size=16), max_size=4)
    if name == "kept_tiers":
        return st.lists(st.sampled_from(["cpu", "disk"]), max_size=2)
    if name in P.STR_PATTERN:
        return st.from_regex(P.STR_PATTERN[name]).filter(lambda s: len(s) <= P.STR_MAX[name])
    if typ == "bin":
        return st.binary(max_size=64)
    if name == "layout":  # typed where it enters: a whole valid layout, or a resume's changes to one
        sizes = st.fixed_dictionaries({"gpu_blocks": st.integers(1, 2**31 - 1), "layers": st.integers(1, 4096)})
        if kind == "resume":
            return sizes.flatmap(lambda d: st.sampled_from([{}, {"gpu_blocks": d["gpu_blocks"]}, d]))
        return sizes.map(lambda d: CacheLayout(**d).to_wire())
    return _STRATEGIES[typ]


def _message(kind):
    required, optional = P.SCHEMAS[kind]
    req = st.fixed_dictionaries({k: _field(kind, k, t) for k, t in required.items()})
    opt = st.fixed_dictionaries({}, optional={k: _field(kind, k, t) for k, t in optional.items()})
    return st.tuples(req, opt).map(lambda pair: {**pair[0], **pair[1]})


@pytest.mark.parametrize("kind", sorted(P.SCHEMAS))
def test_every_kind_round_trips(kind):
    @settings(max_examples=25, deadline=None)
    @given(_message(kind))
    def check(fields):
        frame = P.encode(kind, **dict(fields))
        msg = P.decode(frame)
        assert as_map(msg) == {**fields, "v": 1, "kind": kind}
        assert P.decode(frame, (kind,)) == msg

    check()


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["swap_out", "swap_in"]),
    st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=1, max_size=64),
    st.data(),
)
def test_swap_body_round_trips(op, src, data):
    dst = data.draw(st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=len(src), max_size=len(src)))
    body = P.decode_body(P.encode_body(op, src, dst))
    assert (body.op, body.src, body.dst, body.tier, body.seed) == (op, src, dst, "gpu", 0)


@settings(max_examples=50, deadline=None)
@given(
    st.sampled_from([t for t in P.TIERS if t != "store"]),
    uint,
    st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=16),
)
def test_fill_and_checksum_bodies_round_trip(tier, seed, ids):
    fill = P.decode_body(P.encode_body("fill", None, ids, tier=tier, seed=seed))
    assert (fill.op, fill.src, fill.dst, fill.tier, fill.seed) == ("fill", [], ids, tier, seed)
    check = P.decode_body(P.encode_body("checksum", ids, tier=tier))
    assert (check.op, check.src, check.dst, check.tier) == ("checksum", ids, [], tier)


def test_key_order_and_unknown_fields_do_not_matter():
    frame = msgpack.packb({"kind": "ping", "extra": [1, 2], "req": 3, "v": 1})
    assert P.decode(frame) == M.Ping(req=3)


def test_nil_optional_field_is_absent():
    assert P.decode(msgpack.packb({"v": 1, "kind": "pause", "req": 1, "timeout_ms": None})) == M.Pause(req=1)


def test_largest_safe_integer_passes_and_next_fails():
    assert P.decode(P.encode("ping", req=P.MAX_SAFE_INT)).req == 2**53 - 1
    with pytest.raises(P.ProtocolError):
        P.decode(P.encode("ping", req=P.MAX_SAFE_INT + 1))


@pytest.mark.parametrize(
    "n,lo,hi,ok", [(1, 1, 2, True), (2, 1, 2, True), (0, 1, 2, False), (3, 1, 2, False), (2, 1, 1, False)]
)
def test_check_frames(n, lo, hi, ok):
    frames = [b"x"] * n
    if ok:
        P.check_frames(frames, lo, hi)
    else:
        with pytest.raises(P.ProtocolError) as info:
            P.check_frames(frames, lo, hi)
        assert info.value.code == "malformed"


# --- the document's worked example ---------------------------------------------------


def test_worked_example_in_the_document_matches_the_vectors():
    """Every hex dump in docs/protocol.md §13 is a frame the codec agrees with."""
    doc = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    section = doc.split("## 13.", 1)[1].split("## 14.", 1)[0]
    dumps = []
    for block in section.split("```")[1::2]:
        lines = [line.split("   ")[0] for line in block.strip().splitlines()]  # drop the margin notes
        dumps.append(bytes.fromhex(" ".join(lines)))
    known = {bytes.fromhex(v["hex"]) for v in VALID}
    assert len(dumps) == 4 and all(d in known for d in dumps)
    assert P.decode(dumps[0]).kind == "submit" and P.decode_body(dumps[1]).src == [3, 4]
    assert P.decode(dumps[2]).kind == "task" and P.decode(dumps[3]).kind == "result"
    inline = [
        bytes.fromhex(h)
        for h in re.findall(r"`((?:[0-9a-f]{2} ){8,}[0-9a-f]{2})`", section.split("**A request and its reply**")[1])
    ]
    assert len(inline) == 3
    assert P.decode(inline[0]) == M.Ping(req=7)
    assert P.decode(inline[1]) == M.Reply(req=7, op="ping")
    with pytest.raises(P.ProtocolError) as info:
        P.decode(inline[2])
    assert info.value.code == "bad_version"


def test_every_error_is_a_zkv_error_with_a_code_and_a_reason():
    from zkv import ZkvError
    from zkv.prefix.manager import CacheClearedError, InvalidBlockError
    from zkv.rank.errors import CacheError

    for err in (
        P.ProtocolError("bad_field", "x"),
        CacheError("bad_layout", "y"),
        CacheClearedError("z"),
        InvalidBlockError("w"),
    ):
        assert isinstance(err, ZkvError) and err.code and err.reason
    assert str(CacheClearedError("resume first")) == "resume first" and CacheClearedError("r").code == "cache_cleared"
    assert isinstance(InvalidBlockError("w"), ValueError) and isinstance(CacheError("bad_layout", "y"), ValueError)


def test_pack_ids_never_imports_torch():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(P))
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "torch"]


_LEAVES = st.one_of(
    st.integers(min_value=-(2**60), max_value=2**60),
    st.text(max_size=5) | st.just("x" * (P.MAX_STR + 1)),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.binary(max_size=3),
)
_NESTED = st.recursive(
    _LEAVES,
    lambda inner: (
        st.lists(inner, max_size=40) | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=40)
    ),
    max_leaves=400,
)


#: each bound of check_nested on both sides, nested and not: what the quick check must never take
_AT_THE_BOUNDS = (
    [0] * P.MAX_NEST_ITEMS,
    [0] * (P.MAX_NEST_ITEMS + 1),
    {"a": [0] * (P.MAX_NEST_ITEMS - 3), "b": [None]},
    {"a": [0] * (P.MAX_NEST_ITEMS - 3), "b": [None, None]},
    [[[[[]]]]],
    [[[[[1]]]]],
    {"a": {"b": {"c": {"d": {}}}}},
    {"a": {"b": {"c": {"d": {"e": None}}}}},
    [P.MAX_SAFE_INT, -P.MAX_SAFE_INT, "x" * P.MAX_STR, {"y" * P.MAX_STR: 1}],
    [0, P.MAX_SAFE_INT + 1],
    {"a": [-P.MAX_SAFE_INT - 1, 0]},
    [[["x" * (P.MAX_STR + 1)]]],
    {"a": {"y" * (P.MAX_STR + 1): 1}},
    {"a": {1: 1}},
    [True, 1.5, None, b"", {"a": False}],
)


def _at_the_bounds(test):
    for value in _AT_THE_BOUNDS:
        test = example(value)(test)
    return test


LONG_FUZZ = os.environ.get("ZKV_LONG_FUZZ") == "1"  # the long profile: 2,000 random values, 1-3 minutes


@pytest.mark.timeout(1800 if LONG_FUZZ else 120)
@settings(max_examples=2_000 if LONG_FUZZ else 100, deadline=None)  # and every value at the bounds above
@_at_the_bounds
@given(_NESTED)
def test_the_quick_nested_check_takes_exactly_what_the_full_one_takes(value):
    def verdict(**budget):
        try:
            P.check_nested(value, "m.stats", **budget)
        except P.ProtocolError as err:
            return err.code, err.reason
        return None

    assert verdict() == verdict(budget=[P.MAX_NEST_ITEMS])  # an explicit budget takes the full walk


def test_the_quick_nested_check_keeps_the_depth_rule():
    four = {"a": {"b": {"c": {"d": 1}}}}
    P.check_nested(four, "m.stats")
    with pytest.raises(P.ProtocolError, match="beyond 2"):
        P.check_nested(2**53, "m.stats")
    for five in ({"a": four}, {"a": {"b": {"c": {"d": {"e": 1}}}}}, [[[[[1]]]]]):
        with pytest.raises(P.ProtocolError, match="deeper than 4"):
            P.check_nested(five, "m.stats")


def test_a_fill_or_checksum_of_the_keyed_store_is_refused_naming_why():
    for body in (P.encode_body("fill", None, [1], tier="store"), P.encode_body("checksum", [1], tier="store")):
        with pytest.raises(P.ProtocolError, match="holds values by key"):
            P.decode_body(body)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["put", "get"]),
    st.lists(st.binary(min_size=1, max_size=255), min_size=1, max_size=8, unique=True),
    st.text(alphabet="0123456789abcdef", min_size=1, max_size=64),
)
def test_keyed_bodies_round_trip_with_one_key_per_cpu_row(op, keys, ns):
    rows = list(range(len(keys)))
    src, dst = (rows, None) if op == "put" else (None, rows)
    body = P.decode_body(P.encode_body(op, src, dst, keys=keys, ns=ns))
    assert (body.op, body.keys, body.ns) == (op, keys, ns)
    assert (body.src if op == "put" else body.dst) == rows


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"op": "put", "src": [1, 2], "keys": [b"a"], "ns": "n"}, "2 CPU rows but 1 keys"),
        ({"op": "put", "src": [1], "dst": [1], "keys": [b"a"], "ns": "n"}, "not by ids"),
        ({"op": "get", "dst": [1, 2], "keys": [b"a", b"a"], "ns": "n"}, "a key twice"),
        ({"op": "get", "dst": [1], "keys": [b"a"], "ns": "N!"}, "ns: 1-64"),
        ({"op": "get", "dst": [1], "keys": [b"a"]}, "ns: 1-64"),
        ({"op": "put", "keys": [], "ns": "n"}, "at least one CPU row"),
        ({"op": "put", "src": [1], "keys": b"\x05ab", "ns": "n"}, "runs past the end"),
        ({"op": "put", "src": [1], "keys": b"\x00", "ns": "n"}, "empty"),
    ],
)
def test_a_keyed_body_that_breaks_a_rule_is_refused_naming_it(fields, why):
    op = fields.pop("op")
    with pytest.raises(P.ProtocolError, match=why):
        P.decode_body(P.encode_body(op, fields.pop("src", None), fields.pop("dst", None), **fields))
