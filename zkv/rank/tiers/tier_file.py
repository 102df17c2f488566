"""The file a persistent CPU tier (``tiers.cpu_tier.CpuTier``) lives in, so that it outlives the rank
process (docs/architecture.md, "Memory below and beyond one process").

A tier file (in ``/dev/shm`` by default: host memory that no process owns)
is named by the bus, the rank and a digest of the block shape
(``zkv-tier-<bus>-r<rank>-<layout>``), so a tier of another layout is never
mapped.  It holds a file header, the rows (block-major, one row per block)
and one 48-byte header per row, written *after* the row's bytes:

    mark (4 bytes, ``ZKVB`` when valid) · 0 (u32) · generation (u64) ·
    layout digest (16 bytes) · BLAKE2b-128 of the row (16 bytes, zero: none)

Rows start page-aligned (``ROW_ALIGN``), so the disk tier's O_DIRECT I/O
goes straight between a row and its file: the file header is one page, and
rows whose size is not a multiple of a page are padded to one when that
costs at most 1/16 more (``row_stride``); a file of padded rows is format
version 2, one of packed rows version 1 (the layouts are otherwise one).

A write sets the mark to "being written" first and to valid last, so a
write torn by a kill leaves a row whose header does not check: that block
is lost, never served.  A row not written in the current generation (its
header all zeros, or sealed at another generation) holds nothing: it is
lost too, never served as zeros.  A tier in host memory dies only with the
host, so the mark is what catches the tears it can suffer; the row digest is opt-in
(``TierPlace.digests``, ``zkv worker --tier-digests``) because hashing a row
costs several times copying it (BLAKE2b ~0.3-0.7 GB/s per core against a
copy's several GB/s).  With it, a row's bytes are checked against the digest
when it is read.  Reopening checks the headers only (cheap whatever the size).

The process mapping a tier holds an exclusive ``flock`` on it for as long as
it is mapped: a second process of the same rank cannot map it, and a tier
whose lock can be taken has no owner (``zkv tier list`` / ``clean``).
No torch here: the CLI and the harness list and clean tiers without it."""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Hashable, Iterator

import numpy as np

PREFIX = "zkv-tier-"
DEFAULT_DIR = "/dev/shm"
MAGIC = b"ZKVTIER1"
VERSION = 1  # packed rows; 2: rows padded to ROW_ALIGN (see row_stride)
HEADER_BYTES = 4096  # the rows start page-aligned
ROW_ALIGN = 4096  # the disk tier's O_DIRECT alignment (disk_io.ALIGN)
_HEAD = struct.Struct("<8sIIQQ16sQII64s")  # magic, version, header bytes, rows, row bytes, layout, gen, pid, rank, bus
ROW_HEAD = struct.Struct("<4sIQ16s16s")  # mark, 0, generation, layout digest, row digest
ROW_HEAD_BYTES = ROW_HEAD.size
MARK = b"ZKVB"
WRITING = b"ZKVW"  # the mark while a row is being written
_NO_DIGEST = bytes(16)  # a row sealed without a digest
_MARK_U8 = np.frombuffer(MARK, dtype=np.uint8)
_WRITING_U8 = np.frombuffer(WRITING, dtype=np.uint8)
_FEW_ROWS = 8  # up to this many rows, plain row indexing beats numpy's fancy indexing
_GEN_AT = 8 + 4 + 4 + 8 + 8 + 16  # offset of the file header's generation
_PID_AT = _GEN_AT + 8


def layout_digest(key: Hashable) -> bytes:
    """16 bytes naming a block shape (the store's ``tier_key``: plain ints and strings)."""
    return hashlib.blake2b(repr(key).encode(), digest_size=16).digest()


def bus_name(backend: str) -> str:
    """A bus id for file names: a digest of the rank-facing address every rank of one bus connects to."""
    return hashlib.blake2b(backend.encode(), digest_size=6).hexdigest()


def _put(target: np.ndarray, rows: list[int], value: Any) -> None:
    """``target[rows] = value``; a few rows one by one, where numpy's fancy
    indexing would cost several microseconds (a 1-block task seals one row)."""
    if len(rows) <= _FEW_ROWS:
        for r in rows:
            target[r] = value
    else:
        target[np.asarray(rows, dtype=np.intp)] = value


@dataclass(frozen=True)
class TierPlace:
    """Where a rank's persistent CPU tiers live: a directory, the bus and the rank.
    ``digests``: also keep and check each row's BLAKE2b (see ``TierFile.seal``)."""

    bus: str
    rank: int
    directory: str = DEFAULT_DIR
    digests: bool = False

    def path(self, digest: bytes) -> Path:
        return Path(self.directory) / f"{PREFIX}{self.bus}-r{self.rank}-{digest.hex()[:16]}"


def journal_path(directory: str | Path, bus: str) -> Path:
    """Where an engine that keeps an index of a bus's tier files writes it (a vLLM
    engine's journal, ``rows/journal.py``): beside them, gone with them."""
    return Path(directory) / f"zkv-index-{bus}.journal"


def row_stride(row_bytes: int, pad: bool = True) -> int:
    """Bytes from one row to the next: ``row_bytes`` rounded up to ``ROW_ALIGN`` when
    ``pad`` and that costs at most 1/16 more memory, else ``row_bytes``."""
    aligned = -(-row_bytes // ROW_ALIGN) * ROW_ALIGN
    return aligned if pad and (aligned - row_bytes) * 16 <= row_bytes else row_bytes


def _rows_at(rows: int, stride: int) -> int:
    return HEADER_BYTES + -(-rows * stride // 64) * 64


def row_head_offset(rows: int, row_bytes: int, row: int, stride: int | None = None) -> int:
    """Where row ``row``'s header starts in a tier file of that shape (tools and tests)."""
    return _rows_at(rows, stride or row_bytes) + row * ROW_HEAD_BYTES


class TierFile:
    """One mapped tier file (see the module docstring); ``data`` is the rows'
    bytes, ``heads`` the row headers as a ``[rows, 48]`` uint8 array.

    ``kept`` is True when an existing file of this layout was mapped again;
    ``gen`` is then the generation its content belongs to, and ``valid`` the
    rows whose header checked."""

    def __init__(
        self, place: TierPlace, key: Hashable, rows: int, row_bytes: int, gen: int = 0, stride: int | None = None
    ):
        self.digest = layout_digest(key)
        self.digests = place.digests
        self.path = place.path(self.digest)
        self.rows, self.row_bytes = rows, row_bytes
        self.stride = stride or row_bytes  # bytes from one row to the next (row_stride)
        self.version = VERSION if self.stride == row_bytes else 2
        self.kept = False
        size = _rows_at(rows, self.stride) + rows * ROW_HEAD_BYTES
        os.makedirs(place.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                from ..errors import CacheError  # torch: only a rank that maps a tier gets here

                raise CacheError("tier_in_use", f"CPU tier {self.path} is mapped by another live process") from None
            head = os.pread(fd, _HEAD.size, 0)
            if len(head) == _HEAD.size and self._matches(head) and os.fstat(fd).st_size == size:
                self.kept = True
                self.gen = _HEAD.unpack(head)[6]
            else:
                os.ftruncate(fd, 0)  # another shape, a torn header or a new file: start empty
                os.ftruncate(fd, size)
                self.gen = gen
                fields = (self.version, HEADER_BYTES, rows, row_bytes, self.digest, gen, 0, place.rank)
                os.pwrite(fd, _HEAD.pack(MAGIC, *fields, place.bus.encode()[:64]), 0)
            os.pwrite(fd, struct.pack("<I", os.getpid()), _PID_AT)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        start = _rows_at(rows, self.stride)
        buf = np.frombuffer(self._map, dtype=np.uint8)
        self.data = buf[HEADER_BYTES : HEADER_BYTES + rows * self.stride].reshape(rows, self.stride)[:, :row_bytes]
        self.heads = buf[start : start + rows * ROW_HEAD_BYTES].reshape(rows, ROW_HEAD_BYTES)
        self.valid = self.check_heads() if self.kept else np.zeros(rows, dtype=bool)
        self._head: tuple[int, np.ndarray, bytes] | None = None  # _head_at's header, made once per generation

    def _matches(self, head: bytes) -> bool:
        magic, version, hb, rows, row_bytes, digest = _HEAD.unpack(head)[:6]
        return (magic, version, hb, rows, row_bytes, digest) == (
            MAGIC,
            self.version,
            HEADER_BYTES,
            self.rows,
            self.row_bytes,
            self.digest,
        )

    def check_heads(self) -> np.ndarray:
        """Which rows' headers check (mark, generation, layout): headers only, no row bytes read."""
        return self._checks(self.heads)

    def _checks(self, heads: np.ndarray) -> np.ndarray:
        mark = heads[:, 0:4] == _MARK_U8
        gen = heads[:, 8:16].copy().view("<u8")[:, 0] == self.gen
        layout = heads[:, 16:32] == np.frombuffer(self.digest, dtype=np.uint8)
        return mark.all(axis=1) & gen & layout.all(axis=1)

    def set_gen(self, gen: int) -> None:
        """The content now belongs to generation ``gen`` (rows of another one stop checking)."""
        if gen != self.gen:
            self.gen = gen
            self._map[_GEN_AT : _GEN_AT + 8] = struct.pack("<Q", gen)

    def unseal(self, rows: list[int]) -> None:
        """Before rows are written: their headers stop checking (the mark says
        "being written" first: a kill now leaves a lost row, never an empty one)."""
        _put(self.heads[:, 0:4], rows, _WRITING_U8)

    def seal(self, rows: list[int], gen: int) -> None:
        """After rows are written: header (and digest), then every mark last.  ``gen``:
        the generation when the write began (a row written across a move does not check)."""
        heads = self.heads
        _put(heads[:, 4:48], rows, self._head_at(gen)[0])
        if self.digests:
            for r in rows:
                heads[r, 32:48] = np.frombuffer(self._row_digest(r), dtype=np.uint8)
        _put(heads[:, 0:4], rows, _MARK_U8)
        _put(self.valid, rows, gen == self.gen)

    def _head_at(self, gen: int) -> tuple[np.ndarray, bytes]:
        """A row sealed at ``gen``: its header after the mark (what ``seal`` writes),
        and its first 32 bytes (what ``lost`` finds in a row that checks); made
        once per generation."""
        cached = self._head
        if cached is None or cached[0] != gen:
            packed = ROW_HEAD.pack(MARK, 0, gen, self.digest, _NO_DIGEST)
            cached = self._head = (gen, np.frombuffer(packed, np.uint8)[4:], packed[:32])
        return cached[1], cached[2]

    def _row_digest(self, row: int) -> bytes:
        return hashlib.blake2b(self.data[row], digest_size=16).digest()

    def lost(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """The rows among ``rows`` that must not be served, as ``(empty, torn)``:
        ``empty`` holds nothing of this generation (never written since the file
        was made: its header is all zeros; or sealed at another generation);
        ``torn`` was being written when its writer died, or its header or
        digest does not check.  Headers are checked
        together; with digests, each row's bytes are hashed here."""
        if not self.digests and len(rows) <= _FEW_ROWS:  # the common case, a few rows that check
            heads, sealed = self.heads, self._head_at(self.gen)[1]
            if all(heads[r, :32].tobytes() == sealed for r in rows):
                return [], []
        idx = np.fromiter(dict.fromkeys(rows), dtype=np.intp)
        heads = self.heads[idx]
        ok = self._checks(heads)
        sealed = (heads[:, 0:4] == _MARK_U8).all(axis=1)
        other_gen = sealed & (heads[:, 8:16].copy().view("<u8")[:, 0] != self.gen)
        torn = ~ok & ~other_gen & heads.any(axis=1)
        if self.digests:
            for i in np.flatnonzero(ok):
                stored = bytes(heads[i, 32:48])
                if stored != _NO_DIGEST and self._row_digest(int(idx[i])) != stored:
                    ok[i], torn[i] = False, True
        empty = ~ok & ~torn
        return [int(r) for r in idx[empty]], [int(r) for r in idx[torn]]

    def close(self, unlink: bool = False) -> None:
        """Unmap (views of ``data`` must be gone) and, if ``unlink``, remove the file."""
        if self._fd < 0:
            return
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.data = self.heads = np.zeros((0, 0), dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a view still holds it: the mapping goes with that view
        os.close(self._fd)  # drops the lock
        self._fd = -1


@dataclass(frozen=True)
class TierInfo:
    """A tier file as ``zkv tier list`` shows it."""

    path: Path
    bus: str
    rank: int
    rows: int
    row_bytes: int
    gen: int
    pid: int
    owned: bool  # a live process holds it mapped
    nbytes: int


def list_tiers(directory: str = DEFAULT_DIR) -> Iterator[TierInfo]:
    """Every tier file in ``directory`` (unreadable or foreign ones skipped)."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = Path(directory) / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            head = os.pread(fd, _HEAD.size, 0)
            if len(head) != _HEAD.size or not head.startswith(MAGIC):
                owned, fields = False, None
            else:
                fields = _HEAD.unpack(head)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                owned = False
            except BlockingIOError:
                owned = True
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if fields is None:
            yield TierInfo(path, "?", -1, 0, 0, 0, 0, owned, size)
        else:
            bus = fields[9].rstrip(b"\0").decode(errors="replace")
            yield TierInfo(path, bus, fields[8], fields[3], fields[4], fields[6], fields[7], owned, size)


def remove_tier(path: Path, dry_run: bool = False) -> bool:
    """Remove a tier file (or a rank lock) no live process holds; False when one does.
    ``dry_run``: only say whether it would be removed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not dry_run:
            os.unlink(path)
        return True
    finally:
        os.close(fd)


def clean_tiers(
    directory: str = DEFAULT_DIR, bus: str | None = None, dry_run: bool = False, keep: Collection[Path] = ()
) -> list[Path]:
    """Remove every tier file (of ``bus``, when given) that no live process holds, but those in
    ``keep``; return their paths (``dry_run``: those it would remove, removing none)."""
    removed = []
    for info in list_tiers(directory):
        if info.path in keep:
            continue
        if not info.owned and (bus is None or info.bus == bus) and remove_tier(info.path, dry_run):
            removed.append(info.path)
            # A vLLM engine's journal of this bus names rows of the file: it goes with it.
            journal = journal_path(directory, info.bus)
            if journal.exists():
                if not dry_run:
                    journal.unlink(missing_ok=True)
                removed.append(journal)
    return removed


__all__ = ["clean_tiers", "TierFile", "TierInfo", "TierPlace", "bus_name", "layout_digest", "list_tiers", "remove_tier"]
