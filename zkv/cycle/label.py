"""A cycle's durable record on each engine: its weight version label (vLLM's
``/update_weight_version``) says which cycle holds the engine, in which phase,
what the label was before and who drives it, so that a driver that died is
replaced by one that runs the same cycle again (docs/engine-vllm.md, "The
cycle's record").

The label is ``zkv-cycle:`` followed by ``v1.`` and the record, a msgpack
array in base64url: data, never a string split and parsed back.  Everything
in it is range-checked where it is read (``decode``): a label that starts
with the prefix and does not check raises ``LabelError``, so a cycle never
takes a record it cannot read for none.  Any other label is the engine's own
(``decode`` returns None)."""

from __future__ import annotations

import base64
import binascii
import re

import msgspec

from .terms import Phase

PREFIX = "zkv-cycle:"
VERSION = "v1."
ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_LABEL = 256  # a user's label (before and after a cycle) in a record
MAX_HOST = 255
MAX_PID = 2**22  # Linux's pid_max ceiling
MAX_UNTIL = 2**40  # seconds since the epoch: far beyond any deadline


class LabelError(ValueError):
    """A label with the cycle prefix whose record does not check."""


class CycleRecord(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Cycle ``cycle`` holds this engine in ``phase``; ``old`` is the label it had (None: none),
    ``new`` the one it gets when the cycle commits (None: the cycle's default); the driver is
    process ``pid`` on ``host`` and stops by ``until`` (seconds since the epoch: its deadline)."""

    cycle: str
    phase: Phase
    old: str | None
    new: str | None
    host: str
    pid: int
    until: int

    def check(self) -> "CycleRecord":
        if not ID.match(self.cycle):
            raise LabelError(f"cycle id {self.cycle!r}: 1-64 of [A-Za-z0-9._-]")
        for what, text in (("old", self.old), ("new", self.new)):
            if text is not None and (len(text) > MAX_LABEL or not text.isprintable()):
                raise LabelError(f"the {what} label is not printable or longer than {MAX_LABEL}")
        if not self.host or len(self.host) > MAX_HOST or not self.host.isprintable():
            raise LabelError(f"host {self.host!r}: 1-{MAX_HOST} printable characters")
        if not 0 < self.pid <= MAX_PID:
            raise LabelError(f"pid {self.pid} out of range")
        if not 0 <= self.until <= MAX_UNTIL:
            raise LabelError(f"until {self.until} out of range")
        return self

    def at(self, phase: Phase) -> "CycleRecord":
        return msgspec.structs.replace(self, phase=phase)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CycleRecord, strict=True)


def encode(record: CycleRecord) -> str:
    raw = _encoder.encode(record.check())
    return PREFIX + VERSION + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def is_record(label: str | None) -> bool:
    return label is not None and label.startswith(PREFIX)


def decode(label: str | None) -> CycleRecord | None:
    """The record a label holds; None for a label that is not a cycle's."""
    if not is_record(label):
        return None
    assert label is not None
    body = label[len(PREFIX) :]
    if not body.startswith(VERSION):
        raise LabelError(f"a cycle record of another version ({body[:8]!r}): written by another zkv")
    payload = body[len(VERSION) :]
    if len(payload) > 4 * (MAX_LABEL * 2 + MAX_HOST + 128):
        raise LabelError("a cycle record longer than any this zkv writes")
    try:
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        record = _decoder.decode(raw)
    except (binascii.Error, ValueError, msgspec.DecodeError) as err:
        raise LabelError(f"a cycle record that does not decode: {err}") from None
    return record.check()
