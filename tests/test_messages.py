"""The typed messages are the schema table's: same kinds, same fields, same frames."""

import msgpack
import pytest

from zkv.wire import protocol as P
from zkv.wire.messages import MESSAGES, Ack, Control, Reply, Submit, from_wire


def test_one_class_per_kind_with_the_schema_fields():
    assert set(MESSAGES) == set(P.SCHEMAS)
    for kind, cls in MESSAGES.items():
        required, optional = P.SCHEMAS[kind]
        names = [f for f in cls.__dataclass_fields__ if f != "extra"]
        assert names == [*required, *optional] and cls.KIND == kind


def test_round_trip_equals_the_dict_codec():
    ack = Ack(epoch=3, op="pause", upto=7)
    frame = ack.to_wire()
    assert P.decode(frame) == {"v": P.VERSION, "kind": "ack", "epoch": 3, "op": "pause", "upto": 7}
    assert Ack.from_wire(frame) == ack and from_wire(frame) == ack
    ctl = Control.from_wire(P.encode("control", epoch=2, op="clear", gen=1, upto=[0, 4], keep_cpu=True))
    assert (ctl.epoch, ctl.op, ctl.upto, ctl.keep_cpu, ctl.layout) == (2, "clear", [0, 4], True, None)


def test_a_reply_keeps_the_fields_of_its_op():
    reply = Reply.from_wire(P.encode("reply", req=4, op="pause", drain_ms=1.5, state="paused"))
    assert reply.req == 4 and reply.extra == {"drain_ms": 1.5, "state": "paused"}
    assert msgpack.unpackb(reply.to_wire())["drain_ms"] == 1.5


def test_bad_frames_are_protocol_errors_and_messages_are_frozen():
    with pytest.raises(P.ProtocolError):
        Submit.from_wire(P.encode("submit", task=-1, reply_to="ipc:///x"))
    with pytest.raises(P.ProtocolError):
        Ack.from_wire(P.encode("ping", req=1))  # another kind
    with pytest.raises(TypeError):
        Ack(op="pause")  # epoch is required
    with pytest.raises(AttributeError):
        Ack(epoch=1, op="run").epoch = 2  # type: ignore[misc]
