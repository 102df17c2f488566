"""The client's typed replies read the broker's words as enum members, and a
word outside the vocabulary as another protocol, not as a silent string."""

from __future__ import annotations

import pytest

from zkv.wire import protocol as P
from zkv.wire.messages import Reply
from zkv.wire.replies import CancelReply, ControlReply, StatusReply
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
