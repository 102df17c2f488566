"""Moved to ``zkv.testing.runner.netns_bus`` in zkv 0.2; this path stops working in zkv 0.3."""

from zkv.wire.moved import moved

moved(globals(), "zkv.testing.runner.netns_bus")
