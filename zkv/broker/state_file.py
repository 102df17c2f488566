"""The broker's durable control state: one small file of two JSON slots.

Why a file of its own rather than only what ranks report on READY: ranks can
be absent, frozen, restarted or disagree when a broker comes back, and none of
them knows what a *client* last asked for (paused? cleared? which layout?).
What ranks report on READY is then reconciled against it (``BrokerCore._ready``).

It is written before every reply that reports a change, so it sits on the
path of every pause, clear and resume (twice each).  A save is one ``pwrite``
of a numbered, checksummed snapshot into the slot the previous save did not
use (~10 us): a process killed at any instant leaves both slots whole (a
write() completes before a signal is taken), and a host that loses power in
the middle of one leaves the other, older snapshot to load.  The bytes reach
the disk on a background thread right after (``fdatasync``), so no reply
waits on it (a temporary file, fsync and rename cost 0.6-1 ms per
save, 1.2-2 ms per pause).  Each slot is a line of JSON (``cat`` shows them).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from pathlib import Path
from typing import Any

from ..wire.protocol import MAX_SAFE_INT
from ..wire.vocab import BusState

log = logging.getLogger("zkv.broker")

FILE_NAME = "broker-state.json"
_STATES = (BusState.RUNNING, BusState.PAUSED, BusState.CLEARED)  # a snapshot holds a stable state


def default_state_path(frontend: str) -> Path | None:
    """Next to an ``ipc://`` frontend; ``None`` for other transports (pass ``--state-file``)."""
    if frontend.startswith("ipc://"):
        return Path(frontend[len("ipc://") :]).parent / FILE_NAME
    return None


def check_snapshot(data: Any) -> dict[str, Any]:
    """Range-check a loaded snapshot; raise ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("state") not in _STATES:
        raise ValueError(f"state {data.get('state')!r} is not one of {', '.join(_STATES)}")
    for name in ("epoch", "gen", "world"):
        value = data.get(name)
        if type(value) is not int or not 0 <= value < MAX_SAFE_INT // 2:
            raise ValueError(f"{name} {value!r} is not a small non-negative integer")
    value = data.get("cpu_gen", 0)
    if type(value) is not int or not 0 <= value < MAX_SAFE_INT // 2:
        raise ValueError(f"cpu_gen {value!r} is not a small non-negative integer")
    for name in ("gen_used", "keep_cpu", "cpu_used"):
        if type(data.get(name, False)) is not bool:
            raise ValueError(f"{name} must be a boolean")
    if data.get("layout") is not None and not isinstance(data["layout"], dict):
        raise ValueError("layout must be an object or null")
    if not isinstance(data.get("gen_reason", ""), str):
        raise ValueError("gen_reason must be a string")
    weights = data.get("weights")
    if weights is not None and (not isinstance(weights, str) or not 0 < len(weights) <= 256):
        raise ValueError("weights must be null or a string of 1-256 characters")
    return data


SLOT_BYTES = 32768  # a snapshot's JSON is well under this (gen_reason is capped below)
_REASON_CHARS = 2000
# The background fdatasync starts this long after a save: the reply that
# save preceded is still on its way to the client and the ranks' next work
# is starting, and the saves of one quick op (begin, end) share one sync.
_SYNC_AFTER_S = 0.005


class StateFile:
    """Load and save the broker's snapshot at ``path`` (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.seq = 0  # the number of the newest snapshot in the file
        self._fd: int | None = None
        self._dirty = threading.Event()
        self._closing = threading.Event()
        self._syncer: threading.Thread | None = None

    def load(self) -> dict[str, Any] | None:
        """The newest whole snapshot, or None when there is none (a first start).
        A file with no readable snapshot raises ValueError: starting ``running``
        over a state a client set would be the silent loss this file exists
        to prevent."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            if data[:1] == b"{" and len(data) < SLOT_BYTES:  # one plain snapshot: a file from before the slots
                return check_snapshot(json.loads(data))
            slots = [_read_slot(data[i : i + SLOT_BYTES]) for i in range(0, min(len(data), 2 * SLOT_BYTES), SLOT_BYTES)]
            whole = [slot for slot in slots if slot is not None]
            if not whole:
                raise ValueError("no whole snapshot in either slot")
            self.seq, snapshot = max(whole, key=lambda slot: slot[0])
            return check_snapshot(snapshot)
        except ValueError as err:
            raise ValueError(f"broker state file {self.path} is unusable ({err}); fix or remove it") from None

    def save(self, snapshot: dict[str, Any]) -> None:
        if self._fd is None:
            self._open()
        assert self._fd is not None
        if len(snapshot.get("gen_reason") or "") > _REASON_CHARS:
            snapshot = dict(snapshot, gen_reason=snapshot["gen_reason"][:_REASON_CHARS])
        body = json.dumps(snapshot, sort_keys=True, separators=(",", ":"))
        # the bytes json.dumps({"seq", "crc", "snapshot"}, sort_keys=True) writes, the snapshot encoded once
        line = b'{"crc":%d,"seq":%d,"snapshot":%s}' % (zlib.crc32(body.encode()), self.seq + 1, body.encode())
        if len(line) >= SLOT_BYTES:
            raise OSError(f"a broker snapshot of {len(line)} bytes does not fit a {SLOT_BYTES}-byte slot")
        self.seq += 1
        os.pwrite(self._fd, line.ljust(SLOT_BYTES - 1) + b"\n", (self.seq % 2) * SLOT_BYTES)
        if self._syncer is None:
            self._syncer = threading.Thread(target=self._sync_behind, name="zkv-state-fsync", daemon=True)
            self._syncer.start()
        self._dirty.set()

    def _open(self) -> None:
        """Open (or make) the two-slot file; a file in the old one-snapshot form is rewritten by the first save."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size != 2 * SLOT_BYTES:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, 2 * SLOT_BYTES)
        self._fd = fd
        dir_fd = os.open(self.path.parent, os.O_RDONLY)  # the file's name, on disk once
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def sync(self) -> None:
        """Put what was saved on disk."""
        if self._fd is not None:
            os.fdatasync(self._fd)

    def _sync_behind(self) -> None:
        while True:
            self._dirty.wait()
            self._closing.wait(_SYNC_AFTER_S)  # not on the heels of the reply; at once when closing
            self._dirty.clear()
            try:
                self.sync()
            except OSError as err:
                log.error("cannot fsync the broker state %s: %s", self.path, err)
            if self._closing.is_set():
                return

    def close(self, timeout: float = 5.0) -> None:
        """Stop the fsync thread once the last save is on disk (bounded), and close the file."""
        self._closing.set()
        if self._syncer is not None:
            self._dirty.set()
            self._syncer.join(timeout)
        if self._fd is not None and (self._syncer is None or not self._syncer.is_alive()):
            os.close(self._fd)
            self._fd = None


def _read_slot(raw: bytes) -> tuple[int, dict[str, Any]] | None:
    """``(seq, snapshot)`` of a slot, or None for an empty or torn one."""
    try:
        slot = json.loads(raw)
        body = json.dumps(slot["snapshot"], sort_keys=True, separators=(",", ":"))
        if type(slot["seq"]) is int and slot["crc"] == zlib.crc32(body.encode()):
            return slot["seq"], slot["snapshot"]
    except (ValueError, KeyError, TypeError):
        pass
    return None
