"""The client's typed replies read the broker's words as enum members, and a
word outside the vocabulary as another protocol, not as a silent string."""

from __future__ import annotations

import pytest

from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout
from zkv.wire.messages import Reply
from zkv.wire.replies import CancelReply, ControlReply, PingReply, RankStatus, StatusReply, typed
from zkv.wire.vocab import BusState, ControlOp, TaskState


def test_a_status_names_the_bus_state_and_the_op_in_progress_as_members():
    st = StatusReply.from_reply(Reply(req=1, op="status", extra={"state": "pausing", "pending_op": "pause"}))
    assert st.state is BusState.PAUSING and st.pending_op is ControlOp.PAUSE
    assert st.as_dict()["state"] == "pausing"  # the frame's map, as it came


def test_a_reply_that_does_not_say_its_state_has_none():
    assert StatusReply.from_reply(Reply(req=1, op="status", extra={})).state is None
    assert ControlReply.from_reply(Reply(req=2, op="pause", extra={"epoch": 3})).state is None


@pytest.mark.parametrize(
    "reply",
    [
        Reply(req=1, op="status", extra={"state": "sleeping"}),
        Reply(req=1, op="status", extra={"state": "running", "pending_op": "reboot"}),
        Reply(req=2, op="resume", extra={"state": 7}),
        Reply(req=3, op="cancel", extra={"task": 9, "state": "lost"}),
    ],
)
def test_a_word_outside_the_vocabulary_is_a_protocol_error(reply):
    kind = {"status": StatusReply, "resume": ControlReply, "cancel": CancelReply}[reply.op]
    with pytest.raises(P.ProtocolError) as err:
        kind.from_reply(reply)
    assert err.value.code == "bad_field"


@pytest.mark.parametrize("word", list(TaskState))
def test_a_cancel_reply_says_what_the_task_was(word):
    said = {"task": 9, "cancelled": False, "state": word.value}
    answer = CancelReply.from_reply(Reply(req=4, op="cancel", extra=said))
    assert answer.state is word and answer.task == 9
    assert CancelReply.from_reply(Reply(req=5, op="cancel", extra={"task": 9})).state is TaskState.UNKNOWN


@pytest.mark.parametrize(
    "answer",
    [
        PingReply(1),
        CancelReply(2, task=9, cancelled=True, state=TaskState.QUEUED),
        ControlReply(3, control=ControlOp.PAUSE, noop=True, state=BusState.PAUSED, epoch=4, gen=2, note="paused"),
        ControlReply(4, control=ControlOp.CLEAR, noop=True, state=BusState.CLEARED, epoch=5, gen=3, note="cleared"),
        ControlReply(
            5, control=ControlOp.CLEAR, epoch=6, gen=4, cpu_gen=2, state=BusState.CLEARED, elapsed_ms=1.5,
            cancelled=3, freed=4096, ranks_acked=2, world=2,
        ),
        ControlReply(
            6, control=ControlOp.RESUME, epoch=7, gen=5, cpu_gen=2, state=BusState.RUNNING, elapsed_ms=2.25,
            layout=CacheLayout(gpu_blocks=64), cpu_kept=False, note="the CPU tier could not be kept",
            gen_reason="clear", ranks_acked=1, world=2,
        ),
        StatusReply(
            7, state=BusState.RUNNING, epoch=8, gen=6, cpu_gen=3, gen_reason="resume", world=2,
            layout=CacheLayout(), ranks=(RankStatus(0, alive=True, pid=12, host="h", stats={"ops": 1}),),
            queued=1, inflight=2, max_inflight_per_rank=64, pending_op=ControlOp.PAUSE, counters={"tasks": 5},
        ),
    ],
    ids=lambda a: f"{a.op}{'-noop' if getattr(a, 'noop', False) else ''}",
)  # fmt: skip
def test_an_answer_the_broker_builds_reads_back_as_the_same_answer(answer):
    back = typed(P.decode_as(Reply, answer.to_wire()))
    assert back == answer  # every typed field (the frame's own map is not compared)
    assert back.as_dict() == answer.as_dict()


def test_code_that_read_replies_as_maps_keeps_working_for_a_release_and_is_told_what_to_read(tmp_path):
    """A program written against zkv 0.1 (``reply["state"]``, ``reply.get``, ``in``,
    ``dict(reply)``) against a real broker: the frame's values, each read warned."""
    import warnings
    from collections.abc import Mapping

    from test_engine_geometry import BrokerThread

    from zkv.client.client import Client

    with BrokerThread(tmp_path) as b, Client(b.endpoints.frontend) as c:
        st = c.status(timeout=10)
        assert st.state is not None
        with pytest.warns(DeprecationWarning, match=r"reply\.state.*as_dict\(\)") as seen:
            assert st["state"] == st.state.value and st.get("world") == 1 and "epoch" in st
            assert dict(st)["op"] == "status" and isinstance(st, Mapping)
        assert len(seen) >= 5 and all(w.filename == __file__ for w in seen), "each read warned, at the caller"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert st.as_dict()["state"] == st.state.value and st.world == 1, "the typed way is quiet"
            assert bool(c.ping(timeout=10)), "a reply is true"
