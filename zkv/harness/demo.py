"""Moved to ``zkv.harness.prefix.demo`` in zkv 0.2; this path stops working in zkv 0.3."""

from zkv.wire.moved import moved

moved(globals(), "zkv.harness.prefix.demo")
