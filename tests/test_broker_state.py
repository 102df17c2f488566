"""The bus's transition tables, asserted directly (h11's test_state style)."""

import json

import msgpack

from zkv.broker.state import ALREADY, IN_PROGRESS, ON_FAILURE, ON_SUCCESS, BusState, ControlOp, on_failure, stable


def test_every_op_has_a_progress_a_success_and_a_failure_state():
    for op in (ControlOp.PAUSE, ControlOp.CLEAR, ControlOp.RESUME):
        assert op in IN_PROGRESS and op in ON_SUCCESS and op in ON_FAILURE and op in ALREADY
    assert ON_SUCCESS == {ControlOp.PAUSE: BusState.PAUSED, ControlOp.CLEAR: BusState.CLEARED, ControlOp.RESUME: BusState.RUNNING}


def test_failures_go_back_where_the_op_began():
    assert on_failure(ControlOp.PAUSE, BusState.RUNNING) == (BusState.RUNNING, ControlOp.RESUME)
    assert on_failure(ControlOp.CLEAR, BusState.PAUSED) == (BusState.CLEARED, ControlOp.CLEAR)
    assert on_failure(ControlOp.RESUME, BusState.CLEARED) == (BusState.CLEARED, ControlOp.CLEAR)
    assert on_failure(ControlOp.RESUME, BusState.PAUSED) == (BusState.PAUSED, ControlOp.PAUSE)
    assert on_failure(ControlOp.RESUME, BusState.RUNNING) == (BusState.RESUMING, ControlOp.PAUSE)


def test_a_restarted_broker_never_resumes_an_unfinished_op():
    assert stable(BusState.PAUSING, None) == BusState.PAUSED
    assert stable(BusState.CLEARING, None) == BusState.CLEARED
    assert stable(BusState.RESUMING, BusState.CLEARED) == BusState.CLEARED
    assert stable(BusState.RESUMING, BusState.PAUSED) == BusState.PAUSED
    assert stable(BusState.RESUMING, None) == BusState.RUNNING
    assert all(stable(s, None) not in (BusState.PAUSING, BusState.CLEARING, BusState.RESUMING) for s in BusState)


def test_states_are_their_wire_strings():
    assert msgpack.unpackb(msgpack.packb({"state": BusState.PAUSED})) == {"state": "paused"}
    assert json.dumps(ControlOp.CLEAR) == '"clear"'
    assert f"{BusState.CLEARED}" == "cleared" and str(ControlOp.RUN) == "run"
    assert type(msgpack.unpackb(msgpack.packb(BusState.RUNNING))) is str
