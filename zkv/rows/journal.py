"""A tier's journal: which vLLM key each row of zkv's CPU tier file (or
disk tier) serves, written beside the tier so that it lives exactly as long
(``/dev/shm`` dies with the host, a disk directory survives it), and read by
the next engine on the same tiers (docs/engine-vllm.md, "Warm restart").

The file is a header (the engine's ``EngineIdentity`` and its digest, the
bus's CPU generation the rows belong to, the tier's size) and then records
``[key, row]`` (``row`` -1: the key left the tier), appended in the order
the book made them (``book.RowChange``).  Two rules make it safe under a
kill at any point:

- a row's ``put`` is written only after its write ended ``ok`` on every
  rank, so a row a kill tore is named by no record;
- a row's ``drop`` is written before anything can write the row again (the
  manager appends the changes before it answers vLLM or submits a task),
  so a record never names bytes that another key overwrote.

The disk journal is ``fdatasync``ed before a spill that reuses a disk row
(the spill itself syncs its rows), so a power loss cannot keep a record
whose row was rewritten.  Rows are still checked when read (the tier's own
row records: mark, generation, layout, digest): a record is what zkv
serves, never what it trusts blindly.  A journal whose header, identity or
any record does not check is thrown away whole: nothing is adopted.

``replay`` and ``encode`` are pure (the model-based test drives them);
``Journal`` is the thin file around them."""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgpack
import msgspec

from ..wire.vocab import Tier
from .book import RowChange
from .identity import EngineIdentity

MAGIC = b"ZKVJRNL1"
DISK_JOURNAL = "zkv-index.journal"  # in the disk tier's directory (the CPU tier's: tier_file.journal_path)
_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 16
MAX_KEY_BYTES = 1024  # vLLM's keys are block hashes (tens of bytes)
_GONE = -1


@dataclass(frozen=True)
class Header:
    identity: EngineIdentity
    cpu_gen: int
    tier: Tier
    rows: int


@dataclass
class Replay:
    """What a journal says: its header, each key's row (least recently written first),
    and how many records it took."""

    header: Header
    rows: OrderedDict[bytes, int]
    records: int


class JournalError(ValueError):
    """A journal that cannot be read back: nothing of it is served."""


def encode_header(header: Header) -> bytes:
    body = msgpack.packb(
        {
            "identity": msgspec.to_builtins(header.identity),
            "digest": header.identity.digest(),
            "cpu_gen": header.cpu_gen,
            "tier": str(header.tier),
            "rows": header.rows,
        },
        use_bin_type=True,
    )
    return MAGIC + _LEN.pack(len(body)) + body


def encode(changes: list[RowChange]) -> bytes:
    return b"".join(msgpack.packb([c.key, _GONE if c.row is None else c.row]) for c in changes)


def replay(data: bytes) -> Replay:
    """The state a journal's bytes describe; a torn last record (a write a crash
    cut short) is left out, anything else that does not check raises ``JournalError``."""
    if len(data) < len(MAGIC) + _LEN.size or not data.startswith(MAGIC):
        raise JournalError("not a zkv journal (no header)")
    (size,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if size > _MAX_HEADER or start + size > len(data):
        raise JournalError("a torn or oversized header")
    header = _header(data[start : start + size])
    rows: OrderedDict[bytes, int] = OrderedDict()
    holder: dict[int, bytes] = {}
    unpacker = msgpack.Unpacker(raw=False, max_bin_len=MAX_KEY_BYTES, max_array_len=2, max_map_len=0)
    unpacker.feed(data[start + size :])
    records = 0
    try:
        for rec in unpacker:
            if not (isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], bytes) and type(rec[1]) is int):
                raise JournalError(f"record {records} is not [key, row]")
            key, row = rec
            if not _GONE <= row < header.rows:
                raise JournalError(f"record {records} names row {row} of a tier of {header.rows}")
            old = rows.pop(key, None)
            if old is not None:
                holder.pop(old, None)
            if row != _GONE:
                if row in holder:  # the row served another key with no drop between: never trust either
                    raise JournalError(f"record {records} puts row {row} under a second key")
                rows[key], holder[row] = row, key
            records += 1
    except (msgpack.UnpackException, ValueError) as err:
        if isinstance(err, JournalError):
            raise
        raise JournalError(f"record {records} does not decode: {err}") from None
    return Replay(header, rows, records)


def _header(raw: bytes) -> Header:
    try:
        head = msgpack.unpackb(raw, raw=False)
        identity = msgspec.convert(head["identity"], EngineIdentity)
        tier, cpu_gen, rows = Tier(head["tier"]), head["cpu_gen"], head["rows"]
    except (msgpack.UnpackException, msgspec.ValidationError, KeyError, TypeError, ValueError) as err:
        raise JournalError(f"the header does not decode: {err}") from None
    if type(cpu_gen) is not int or type(rows) is not int or cpu_gen < 0 or rows < 0:
        raise JournalError("the header's cpu_gen or rows is out of range")
    if head.get("digest") != identity.digest():
        raise JournalError("the header's identity does not match its digest")
    return Header(identity, cpu_gen, tier, rows)


class Journal:
    """One tier's journal file at ``path`` (see the module docstring)."""

    def __init__(self, path: Path, tier: Tier, rows: int, sync: bool = False):
        self.path, self.tier, self.rows, self.sync = path, tier, rows, sync
        self.records = 0  # appended since the header: compacted when far more than the keys
        self._fd = -1
        self._unsynced = False

    def read(self) -> Replay | None:
        """The journal an earlier engine left, or None (none, or one that does not check)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return replay(data)

    def start(self, identity: EngineIdentity, cpu_gen: int, rows: list[tuple[bytes, int]] = ()) -> None:  # type: ignore[assignment]
        """A new journal (atomically: a crash leaves the old one or this one) naming ``rows``."""
        self.close()
        body = encode_header(Header(identity, cpu_gen, self.tier, self.rows))
        body += encode([RowChange(self.tier, k, r) for k, r in rows])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
            if self.sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.records = len(rows)

    def append(self, changes: list[RowChange]) -> None:
        if self._fd < 0 or not changes:
            return
        os.write(self._fd, encode(changes))
        self.records += len(changes)
        self._unsynced = self._unsynced or any(c.row is None for c in changes)

    def flush_drops(self) -> None:
        """Make the drops written so far durable (before a row they freed is rewritten)."""
        if self.sync and self._unsynced and self._fd >= 0:
            os.fdatasync(self._fd)
        self._unsynced = False

    def remove(self) -> None:
        """Nothing of the tier is served any more (a generation moved): no journal at all."""
        self.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
