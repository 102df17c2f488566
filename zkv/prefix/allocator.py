"""Moved to ``zkv.rows.pool`` in zkv 0.2 (``BlockAllocator`` is ``RowPool`` there,
``BlockAllocatorError`` is ``RowPoolError``); this path stops working in zkv 0.3."""

from zkv.wire.moved import moved

moved(globals(), "zkv.rows.pool", renamed={"BlockAllocator": "RowPool", "BlockAllocatorError": "RowPoolError"})
