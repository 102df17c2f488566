"""Moved to ``zkv.rank.memory.shm_files`` in zkv 0.2; this path stops working in zkv 0.3."""

from zkv.wire.moved import moved

moved(globals(), "zkv.rank.memory.shm_files")
