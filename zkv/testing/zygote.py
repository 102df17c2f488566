"""Moved to ``zkv.testing.runner.zygote`` in zkv 0.2; this path stops working in zkv 0.3."""

from zkv.wire.moved import moved

moved(globals(), "zkv.testing.runner.zygote")
