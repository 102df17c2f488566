"""The broker's durable control state: one small JSON file, replaced atomically.

Why a file of its own rather than only what ranks report on READY: ranks can
be absent, frozen, restarted or disagree when a broker comes back, and none of
them knows what a *client* last asked for (paused? cleared? which layout?).
The state changes only on control operations (rare), so writing it on every
change costs nothing; ``os.replace`` makes each write all-or-nothing.  What
ranks report on READY is then reconciled against it (``BrokerCore._ready``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..wire.protocol import MAX_SAFE_INT

log = logging.getLogger("zkv.broker")

FILE_NAME = "broker-state.json"
_STATES = ("running", "paused", "cleared")


def default_state_path(frontend: str) -> Path | None:
    """Next to an ``ipc://`` frontend; ``None`` for other transports (pass ``--state-file``)."""
    if frontend.startswith("ipc://"):
        return Path(frontend[len("ipc://"):]).parent / FILE_NAME
    return None


def check_snapshot(data: Any) -> dict[str, Any]:
    """Range-check a loaded snapshot; raise ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("state") not in _STATES:
        raise ValueError(f"state {data.get('state')!r} is not one of {_STATES}")
    for name in ("epoch", "gen", "world"):
        value = data.get(name)
        if type(value) is not int or not 0 <= value < MAX_SAFE_INT // 2:
            raise ValueError(f"{name} {value!r} is not a small non-negative integer")
    for name in ("gen_used", "keep_cpu"):
        if type(data.get(name, False)) is not bool:
            raise ValueError(f"{name} must be a boolean")
    if data.get("layout") is not None and not isinstance(data["layout"], dict):
        raise ValueError("layout must be an object or null")
    if not isinstance(data.get("gen_reason", ""), str):
        raise ValueError("gen_reason must be a string")
    return data


class StateFile:
    """Load and atomically save the broker's snapshot at ``path``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        """The saved snapshot, or None when there is none (a first start).
        A file that cannot be read or fails the checks raises ValueError:
        starting ``running`` over a state a client set would be the silent
        loss this file exists to prevent."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return check_snapshot(json.loads(text))
        except ValueError as err:
            raise ValueError(f"broker state file {self.path} is unusable ({err}); fix or remove it") from None

    def save(self, snapshot: dict[str, Any]) -> None:
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(snapshot, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
