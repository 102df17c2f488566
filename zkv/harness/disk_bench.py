"""Moved to ``zkv.harness.bus.disk_bench`` in zkv 0.2; this path stops working in zkv 0.3."""

from zkv.wire.moved import moved

moved(globals(), "zkv.harness.bus.disk_bench")
