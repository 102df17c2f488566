"""Moved to ``zkv.rank.memory.dtypes`` in zkv 0.2; this path stops working in zkv 0.3."""

from zkv.wire.moved import moved

moved(globals(), "zkv.rank.memory.dtypes")
