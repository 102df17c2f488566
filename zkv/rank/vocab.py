"""The words a rank compares: the control ops the broker sends (``ack``,
``control`` and ``welcome`` ``op``), as one enum.  A ``str`` enum, so a
value decoded from the wire compares and encodes as the string it is."""

from __future__ import annotations

import enum


class ControlOp(str, enum.Enum):
    """The bus's control state as a rank applies it (docs/protocol.md)."""

    RUN = "run"
    PAUSE = "pause"
    CLEAR = "clear"
    RESUME = "resume"
