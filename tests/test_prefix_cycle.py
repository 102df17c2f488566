"""The pause / clear / resume steps over a scripted control client: the order of
docs/architecture.md ("The clear / update cycle"), and a consistent manager whichever step of the bus fails;
then the one RL cycle (zkv/cycle/) over a prefix manager, with its rollback and report."""

from __future__ import annotations

import pytest

from zkv.client.client import ZkvError
from zkv.cycle import EngineFleet, Outcome, PrefixEngine, Serves, State, Tiers
from zkv.cycle.prefix import drain_and_clear, pause_clear_resume, resume
from zkv.prefix import CacheClearedError, PrefixCacheManager
from zkv.testing.fakebus import FakeBus
from zkv.wire.layout import CacheLayout
from zkv.wire.replies import ControlReply, StatusReply
from zkv.wire.vocab import ControlOp

BS = 4
LAYOUT = {
    "layers": 2,
    "gpu_blocks": 8,
    "cpu_blocks": 8,
    "block_size": BS,
    "kv_heads": 2,
    "head_dim": 32,
    "dtype": "bf16",
}


class ControlBus(FakeBus):
    """FakeBus plus the control requests of zkv.client.Client, with scripted failures."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail: dict[str, int] = {}  # op -> how many of its next calls fail
        self.state = "running"
        self.layout = dict(LAYOUT)

    def _maybe_fail(self, op: str) -> None:
        self.calls.append(op)
        if self.fail.get(op):
            self.fail[op] -= 1
            raise ZkvError("no_reply", f"no reply to {op}")

    def pause(self, timeout: float = 30.0) -> ControlReply:
        self._maybe_fail("pause")
        if self.state == "running":
            self.state = "paused"
        return ControlReply(1, control=ControlOp.PAUSE, state=self.state, elapsed_ms=0.1)

    def clear(self, keep_cpu: bool = False, timeout: float = 30.0) -> ControlReply:
        self._maybe_fail("clear")
        self.state = "cleared"
        super().clear()
        return ControlReply(1, control=ControlOp.CLEAR, state="cleared", freed=1)

    def resume(self, layout: dict | None = None, timeout: float = 30.0) -> ControlReply:
        self._maybe_fail("resume")
        if layout:
            assert self.state == "cleared"
            self.layout.update(layout)
        self.state = "running"
        return ControlReply(1, control=ControlOp.RESUME, state="running")

    def status(self, timeout: float | None = None) -> StatusReply:
        self._maybe_fail("status")
        return StatusReply(1, state=self.state, layout=CacheLayout.from_wire(dict(self.layout)))


def setup(quarantine: bool = False) -> tuple[ControlBus, PrefixCacheManager, list[int]]:
    bus = ControlBus()
    manager = PrefixCacheManager(bus, BS, 8, 8)
    tokens = list(range(3 * BS))
    fresh = manager.allocate(3)
    manager.insert(tokens, fresh.block_ids)
    manager.release(fresh)
    if quarantine:
        manager.evict(3)
        bus.script("timeout")
        assert manager.match(tokens).num_blocks == 0
        assert manager.stats()["quarantined_blocks"]["gpu"] == 3
    return bus, manager, tokens


def assert_consistent(manager: PrefixCacheManager) -> None:
    manager.check_invariants()
    for tier in ("gpu", "cpu"):
        usage = manager.stats()[tier]
        assert usage["free"] + usage["used"] == usage["total"]


def test_the_cycle_runs_in_design_order_and_serves_the_new_layout():
    bus, manager, tokens = setup(quarantine=True)
    updated = []
    info = pause_clear_resume(bus, manager, {"gpu_blocks": 16}, update=lambda: updated.append(manager.cleared))
    assert bus.calls == ["pause", "clear", "resume", "status"]
    assert updated == [True], "weights are updated while the manager is cleared"
    assert info["quarantine_freed"] == 3 and info["layout"].gpu_blocks == 16
    assert not manager.cleared and manager.stats()["gpu"]["total"] == 16
    assert manager.match(tokens).num_blocks == 0, "nothing survives a clear"
    assert_consistent(manager)


def test_resume_takes_the_block_size_from_the_broker():
    bus, manager, _ = setup()
    pause_clear_resume(bus, manager, {"block_size": 8, "cpu_blocks": 4})
    assert manager.block_size == 8 and manager.stats()["cpu"]["total"] == 4


def test_a_failed_pause_changes_nothing():
    bus, manager, tokens = setup(quarantine=True)
    bus.fail["pause"] = 1
    with pytest.raises(ZkvError):
        drain_and_clear(bus, manager)
    assert not manager.cleared and manager.stats()["quarantined_blocks"]["gpu"] == 3
    assert manager.locate(tokens) == ["cpu"] * 3
    assert_consistent(manager)


def test_a_failed_clear_leaves_the_manager_cleared_and_a_retry_completes_the_cycle():
    bus, manager, tokens = setup()
    bus.fail["clear"] = 1
    with pytest.raises(ZkvError):
        drain_and_clear(bus, manager)
    assert manager.cleared and manager.match(tokens).num_blocks == 0
    with pytest.raises(CacheClearedError):
        manager.allocate(1)
    assert_consistent(manager)
    drain_and_clear(bus, manager)  # pause / clear of a cleared bus are no-ops
    resume(bus, manager)
    assert not manager.cleared and manager.allocate(8).num_blocks == 8


@pytest.mark.parametrize("step", ["resume", "status"])
def test_a_failed_resume_keeps_the_manager_cleared_until_a_retry(step):
    bus, manager, _ = setup()
    drain_and_clear(bus, manager)
    bus.fail[step] = 1
    with pytest.raises(ZkvError):
        resume(bus, manager)
    assert manager.cleared
    assert_consistent(manager)
    resume(bus, manager)
    assert not manager.cleared and manager.stats()["gpu"]["total"] == 8
    assert_consistent(manager)


def test_a_failing_weight_update_leaves_bus_and_manager_cleared():
    bus, manager, _ = setup()

    def update() -> None:
        raise RuntimeError("trainer crashed")

    with pytest.raises(RuntimeError):
        pause_clear_resume(bus, manager, update=update)
    assert bus.calls == ["pause", "clear"] and bus.state == "cleared" and manager.cleared
    resume(bus, manager)
    assert not manager.cleared


def test_resuming_a_merely_paused_bus_keeps_the_cache():
    bus, manager, tokens = setup()
    bus.pause()
    resume(bus, manager)
    lease = manager.match(tokens)
    assert lease.gpu_hit_blocks == 3
    manager.release(lease)
    assert_consistent(manager)


def test_the_one_cycle_over_a_prefix_manager_clears_updates_and_serves_the_new_layout():
    bus, manager, tokens = setup(quarantine=True)
    updated = []
    engine = PrefixEngine("engine-0", bus, manager, {"gpu_blocks": 16})
    with EngineFleet([engine]) as fleet:
        report = fleet.cycle("step-1", lambda e, timeout: updated.append(manager.cleared), stage=False)
    assert report.outcome is Outcome.COMMITTED, report.describe()
    assert bus.calls == ["pause", "clear", "resume", "status"]
    assert updated == [True], "weights are updated while the manager is cleared"
    assert engine.freed == 3 and manager.stats()["gpu"]["total"] == 16 and not manager.cleared
    assert manager.match(tokens).num_blocks == 0, "nothing survives a clear"
    e = report.engines["engine-0"]
    assert e.serves is Serves.NEW and e.tiers is Tiers.DROPPED and e.state is State.SERVING
    assert engine.label == "step-1"
    assert_consistent(manager)


def test_a_failing_update_in_the_one_cycle_rolls_the_manager_back_to_serving():
    bus, manager, _ = setup()
    old = []

    def update(e: object, timeout: float) -> None:
        raise RuntimeError("trainer crashed")

    with EngineFleet([PrefixEngine("engine-0", bus, manager)]) as fleet:
        report = fleet.cycle("step-2", update, rollback=lambda e, timeout: old.append(True), deadline_s=10, stage=False)
    assert report.outcome is Outcome.ROLLED_BACK, report.describe()
    assert "RuntimeError: trainer crashed" in report.engines["engine-0"].why
    assert old == [True] and bus.state == "running" and not manager.cleared
    assert manager.allocate(8).num_blocks == 8
    assert_consistent(manager)


def test_a_bus_that_fails_its_pause_refuses_nothing_and_rolls_back_untouched():
    bus, manager, tokens = setup()
    bus.fail["pause"] = 1
    with EngineFleet([PrefixEngine("engine-0", bus, manager)]) as fleet:
        report = fleet.cycle("step-3", lambda e, timeout: None, deadline_s=10, stage=False)
    assert report.outcome is Outcome.ROLLED_BACK, report.describe()
    e = report.engines["engine-0"]
    assert e.failed_step == "pause_buses" and "no reply to pause" in e.why
    assert not manager.cleared and manager.locate(tokens) == ["gpu"] * 3
