"""The bus's transition tables, asserted directly (h11's test_state style)."""

import json

import msgpack

from zkv.broker.state import ALREADY, IN_PROGRESS, ON_FAILURE, ON_SUCCESS, BusState, ControlOp, on_failure, stable


def test_every_op_has_a_progress_a_success_and_a_failure_state():
    for op in (ControlOp.PAUSE, ControlOp.CLEAR, ControlOp.RESUME):
        assert op in IN_PROGRESS and op in ON_SUCCESS and op in ON_FAILURE and op in ALREADY
    assert ON_SUCCESS == {
        ControlOp.PAUSE: BusState.PAUSED,
        ControlOp.CLEAR: BusState.CLEARED,
        ControlOp.RESUME: BusState.RUNNING,
    }


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


def test_a_save_is_in_the_file_at_once_and_reaches_the_disk_behind_the_reply(tmp_path, monkeypatch):
    """The write (what a killed broker needs) happens inside ``save``; the
    fdatasync (what a host crash needs) runs on its thread, so a save returns
    while the disk is still busy, and ``close`` waits for it."""
    import os
    import threading

    from zkv.broker.state_file import StateFile

    disk = threading.Event()
    synced: list[int] = []
    real_sync = os.fdatasync

    def slow_sync(fd: int) -> None:
        assert disk.wait(10), "the test never let the disk finish"
        synced.append(fd)
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_sync)
    state = StateFile(tmp_path / "broker-state.json")
    snap = {"state": "paused", "epoch": 3, "gen": 1, "world": 2}
    state.save(snap)  # returns although the disk is busy
    assert StateFile(tmp_path / "broker-state.json").load() == snap and synced == []
    disk.set()
    state.close()
    assert synced and state._syncer is not None and not state._syncer.is_alive()


def snap(epoch: int) -> dict:
    return {"state": "paused", "epoch": epoch, "gen": 1, "world": 2, "gen_reason": "x" * 5000}


def test_the_newest_whole_snapshot_wins_and_a_torn_one_leaves_the_one_before(tmp_path):
    from zkv.broker.state_file import SLOT_BYTES, StateFile

    path = tmp_path / "broker-state.json"
    state = StateFile(path)
    for epoch in (1, 2, 3):
        state.save(snap(epoch))
    state.close()
    loaded = StateFile(path).load()
    assert loaded is not None and loaded["epoch"] == 3 and len(loaded["gen_reason"]) == 2000  # capped to fit its slot
    data = bytearray(path.read_bytes())
    newest = (3 % 2) * SLOT_BYTES
    data[newest + 40 : newest + 60] = b"\0" * 20  # the host lost power in the middle of the last write
    path.write_bytes(bytes(data))
    assert StateFile(path).load()["epoch"] == 2
    again = StateFile(path)
    again.load()
    again.save(snap(9))  # numbering goes on from the newest whole slot, into the other slot
    again.close()
    assert StateFile(path).load()["epoch"] == 9


def test_a_file_from_before_the_slots_still_loads_and_nothing_whole_refuses_to_start(tmp_path):
    import pytest

    from zkv.broker.state_file import StateFile

    path = tmp_path / "broker-state.json"
    path.write_text(json.dumps(snap(4)))  # the one-snapshot form earlier brokers wrote
    state = StateFile(path)
    assert state.load()["epoch"] == 4
    state.save(snap(5))
    state.close()
    assert StateFile(path).load()["epoch"] == 5
    path.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="unusable"):
        StateFile(path).load()
