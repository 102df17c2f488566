"""The typed messages are the schema table's: same kinds, same fields, same frames;
the vocabulary's words are the strings the wire carries."""

import msgpack
import pytest

from zkv.wire import fast as F
from zkv.wire import protocol as P
from zkv.wire import sockets as S
from zkv.wire.messages import MESSAGES, Ack, Control, Done, Reply, Submit, kind_of, wire_fields
from zkv.wire.vocab import ControlOp, Dtype, Op, Outcome, Tier


def test_one_class_per_kind_with_the_schema_fields():
    assert set(MESSAGES) == set(P.SCHEMAS)
    for kind, cls in MESSAGES.items():
        required, optional = P.SCHEMAS[kind]
        assert list(wire_fields(cls)) == [*required, *optional] and kind_of(cls) == kind
        assert cls.__struct_fields__[-2:] == ("v", "kind")  # the encoder writes them last


def test_round_trip_equals_the_dict_codec():
    ack = Ack(epoch=3, op="pause", upto=7)
    frame = ack.to_wire()
    assert frame == P.encode("ack", epoch=3, op="pause", upto=7)
    assert msgpack.unpackb(frame) == {"v": P.VERSION, "kind": "ack", "epoch": 3, "op": "pause", "upto": 7}
    assert P.decode(frame) == ack and P.decode_as(Ack, frame) == ack
    ctl = P.decode_as(Control, P.encode("control", epoch=2, op="clear", gen=1, upto=[0, 4], keep_cpu=True))
    assert (ctl.epoch, ctl.op, ctl.upto, ctl.keep_cpu, ctl.layout) == (2, "clear", [0, 4], True, None)


def test_a_fast_decode_equals_the_message_made_by_hand():
    done = Done(seq=1, n=1, outcome="ok", gen=3, bytes=64)
    fast = F.decoder(("done",))(done.to_wire())
    assert type(fast) is Done  # the class itself: equality is msgspec's own
    assert fast == done and not fast != done and done == fast
    assert fast != Done(seq=1, n=1, outcome="ok", gen=3)


def test_a_reply_keeps_the_fields_of_its_op():
    reply = P.decode_as(Reply, P.encode("reply", req=4, op="pause", drain_ms=1.5, state="paused", note=None))
    assert reply.req == 4 and reply.extra == {"drain_ms": 1.5, "state": "paused", "note": None}
    assert msgpack.unpackb(reply.to_wire())["drain_ms"] == 1.5
    assert reply.extra["state"] == "paused" and reply.extra.get("drain_ms") == 1.5
    assert "note" in reply.extra and "gen" not in reply.extra


def test_bad_frames_are_protocol_errors_and_messages_are_frozen():
    with pytest.raises(P.ProtocolError):
        P.decode_as(Submit, P.encode("submit", task=-1, reply_to="ipc:///x"))
    with pytest.raises(P.ProtocolError):
        P.decode_as(Ack, P.encode("ping", req=1))  # another kind
    with pytest.raises(TypeError):
        Ack(op="pause")  # epoch is required
    with pytest.raises(AttributeError):
        Ack(epoch=1, op="run").epoch = 2  # type: ignore[misc]


def test_a_message_is_read_by_attribute_not_as_a_dict():
    ack = P.decode(P.encode("ack", epoch=3, op="pause", upto=7, freed=None))
    assert ack.kind == "ack" and ack.epoch == 3 and ack.upto == 7 and ack.freed is None
    with pytest.raises(TypeError):
        ack["epoch"]
    with pytest.raises(TypeError):
        "upto" in ack  # noqa: B015
    assert not hasattr(ack, "get") and not hasattr(ack, "keys")
    assert ack != ack.as_map() and ack.as_map() == {"v": 1, "kind": "ack", "epoch": 3, "op": "pause", "upto": 7}
    reply = P.decode(P.encode("reply", req=1, op="status", state="running"))
    with pytest.raises(TypeError):
        reply["state"]
    assert not hasattr(reply, "get") and reply.extra == {"state": "running"}


def test_the_vocabulary_is_the_wire_strings():
    assert P.OUTCOMES == tuple(Outcome) and P.OPS == tuple(Op) and P.TIERS == tuple(Tier)
    assert P.DTYPES == tuple(Dtype) and P.CONTROL_OPS == tuple(ControlOp)
    assert Outcome.OK == "ok" and f"{ControlOp.PAUSE}" == "pause" and str(Tier.CPU) == "cpu"
    assert msgpack.packb(Outcome.FAILED) == msgpack.packb("failed")
    assert P.encode("done", seq=1, n=1, outcome=Outcome.OK, gen=1) == P.encode("done", seq=1, n=1, outcome="ok", gen=1)
    assert Done(seq=1, n=1, outcome=Outcome.OK, gen=1).to_wire() == Done(seq=1, n=1, outcome="ok", gen=1).to_wire()
    assert [d.itemsize for d in Dtype] == [2, 2, 4]


def test_a_uint_field_is_typed_with_the_bounds_the_tables_give():
    import typing

    import msgspec

    for kind, cls in MESSAGES.items():
        for f in msgspec.structs.fields(cls):
            if P.SCHEMAS[kind][0].get(f.name, P.SCHEMAS[kind][1].get(f.name)) != "uint":
                continue
            ann = next(a for a in (f.type, *typing.get_args(f.type)) if typing.get_origin(a) is typing.Annotated)
            meta = typing.get_args(ann)[1]
            assert (meta.ge, meta.le) == P.uint_bounds(kind, f.name), (kind, f.name)


@pytest.mark.parametrize("decode", [P.decode, F.decoder(S.BROKER_BACKEND)], ids=["protocol", "fast"])
def test_a_decoded_word_is_its_vocabulary_member(decode):
    from zkv.wire.vocab import RankOutcome

    done = decode(Done(seq=1, n=1, outcome="failed", gen=0).to_wire())
    assert done.outcome is RankOutcome.FAILED and done.outcome == Outcome.FAILED == "failed"
    ack = P.decode(Ack(epoch=1, op="clear", freed=0).to_wire())
    assert ack.op is ControlOp.CLEAR
    assert P.WORDS["outcome"] == {"outcome": Outcome} and P.WORDS["welcome"] == {"op": ControlOp}
