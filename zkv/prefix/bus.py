"""``Bus`` and ``ControlBus`` live beside the book of rows now (``zkv.rows.bus``);
this name stays for code that imports them from here."""

from __future__ import annotations

from ..rows.bus import SWAP_OPS, Bus, ControlBus

__all__ = ["SWAP_OPS", "Bus", "ControlBus"]
