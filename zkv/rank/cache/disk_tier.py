"""Moved to ``zkv.rank.tiers.disk_tier`` in zkv 0.2; this path stops working in zkv 0.3."""

from zkv.wire.moved import moved

moved(globals(), "zkv.rank.tiers.disk_tier")
