"""``DiskTier``: zkv's tier below the CPU tier, one preallocated file per rank.

A disk block is a CPU tier row (every region's page of one block, in region
order) stored with its digest, so that a block read back is exactly the
block written or is reported lost (docs/protocol.md §6, ``spill`` / ``load``).

The file ``zkv-rank{R}.disk`` in the tier's directory holds:

- a superblock (one aligned page): magic, format version, geometry (rows,
  row bytes, slot bytes), the digest algorithm, the *layout key* of the
  blocks it holds, the digest's seed, the bus's *CPU generation* its blocks belong to
  (``cpu_gen``: disk blocks are CPU blocks moved down, so they are gone
  exactly when the bus's CPU content is) and an *epoch*; a file whose
  version, geometry or key differs is never reused (it is made anew);
- a header area: one 32-byte record per row (magic, row, epoch, CRC-32 of the
  record, digest of the row's bytes: ``disk_io.RowDigest``, which says
  why that suffices); a record counts only if its CRC holds
  and its epoch is the superblock's, so invalidating every block (a clear
  that drops the CPU tier, a new layout, a new ``cpu_gen``) is one
  superblock write;
- the rows, each in an aligned slot.

A spill writes the rows, then their header pages, then ``fdatasync``s once
before it returns: a kill -9 before that leaves the row's old record (or
none) beside new bytes, which fails its digest on read (lost, never served);
after it, the block is on the device.  Opening checks the superblock and
counts valid records in one vectorised pass over the header area (fast
whatever the size); digests are checked on every read.  An exclusive
``flock`` keeps a second process off a live rank's file.

Rows go straight between the CPU tier and the file (its rows are
page-aligned, cpu_tier.py), one buffer per run of rows that lie back to back;
only rows that are not (an unaligned address under O_DIRECT) pass through
a bounce buffer.  A big batch is cut into pieces (``disk_io.PIECE``) that
the pool's threads share: one thread's read or write runs while another
computes its piece's digests."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import CacheError
from . import disk_io as io

# magic, version, record size, rows, row bytes, slot bytes, data offset, epoch, digest, layout key, cpu_gen, seed
_SUPER = struct.Struct("<8sIIQQQQI16s16sQQ")
_SUPER_MAGIC = b"ZKVDISK1"
_REC = struct.Struct("<IIII16s")  # magic, row, epoch, crc, digest
_REC_MAGIC = 0x5256_4B5A  # "ZKVR"
_REC_HEAD = struct.Struct("<III")
_VERSION = 2  # 2: the superblock names its cpu_gen (a version-1 file is made anew, never read)
_MAX_EPOCH = 2**31 - 1  # compared as int32 in the vectorised count


@dataclass(frozen=True)
class DiskSpec:
    """Where a rank's disk tier lives and how many blocks it holds (``--disk-dir``, ``--disk-blocks``)."""

    directory: str
    blocks: int
    direct: bool | None = None  # None: probe the directory (disk_io.direct_supported)
    threads: int = 2


class DiskLost(CacheError):
    """Disk blocks that read back other bytes than were written (or hold nothing): they are lost."""

    def __init__(self, reason: str, rows: Sequence[int]):
        super().__init__("disk_lost", reason)
        self.rows = list(rows)

    @classmethod
    def empty(cls, rows: Sequence[int]) -> "DiskLost":
        return cls(f"disk blocks {_names(rows)} hold no block (never spilled, or invalidated)", rows)

    @classmethod
    def torn(cls, rows: Sequence[int]) -> "DiskLost":
        return cls(f"disk blocks {_names(rows)} failed their digest check: lost", rows)


def data_offset(rows: int) -> int:
    """Where row 0's bytes start in a disk tier file of ``rows`` rows: the
    superblock page, then the row records (docs/protocol.md, the disk tier)."""
    return io.ALIGN + io.align_up(rows * _REC.size)


def layout_key(page_shape: Sequence[tuple[str, int]], fields: Sequence[object]) -> bytes:
    """What a disk file's blocks are blocks of: the region pages and the layout's fields."""
    return hashlib.blake2b(repr((tuple(page_shape), tuple(fields))).encode(), digest_size=16).digest()


class DiskTier:
    """One rank's disk file (see the module docstring); driven by one thread at a time."""

    def __init__(self, spec: DiskSpec, row_bytes: int, key: bytes, rank: int = 0, cpu_gen: int = 0):
        if type(spec.blocks) is not int or not 1 <= spec.blocks <= 2**31 - 1:
            raise CacheError("bad_layout", f"a disk tier needs 1..2^31-1 blocks, got {spec.blocks!r}")
        os.makedirs(spec.directory, exist_ok=True)
        self.rows, self.row_bytes, self.key = spec.blocks, row_bytes, key
        self.direct = io.direct_supported(spec.directory) if spec.direct is None else spec.direct
        self.path = os.path.join(spec.directory, f"zkv-rank{rank}.disk")
        self.slot = io.align_up(row_bytes) if self.direct else row_bytes
        self.header_bytes = io.align_up(self.rows * _REC.size)
        self.data_off = data_offset(self.rows)
        self.nbytes = self.data_off + self.rows * self.slot
        self._super = io.aligned(io.ALIGN)
        self._headers = io.aligned(self.header_bytes)
        self._pool = io.IOPool(spec.threads)
        self._bounces: dict[int, object] = {}
        self.stats = {"digest_failures": 0, "write_errors": 0, "read_errors": 0}
        self.cpu_gen = cpu_gen  # a reused file's own, once opened
        self._digest: io.RowDigest
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        self.fd = os.open(self.path, flags, 0o600)
        try:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CacheError("disk_busy", f"{self.path} is held by another live process") from None
            self.reopened = self._open()
        except BaseException:
            os.close(self.fd)
            raise
        self.used = self.reopened
        self.kept = self.reopened > 0  # holds blocks an earlier process spilled (at ``cpu_gen``)

    # --- the file -------------------------------------------------------------------

    def _open(self) -> int:
        """Reuse a file of this geometry and key (return its valid blocks), else make it anew (0)."""
        t0 = time.perf_counter()
        if os.fstat(self.fd).st_size == self.nbytes:
            io.pread_all(self.fd, [self._super], 0)
            fields = self._read_super()
            if fields is not None and fields[1:6] == (self.rows, self.row_bytes, self.slot, self.data_off, self.key):
                self.epoch, self.cpu_gen = fields[0], fields[6]
                self._digest = io.RowDigest(self.row_bytes, fields[7])
                io.pread_all(self.fd, [self._headers], io.ALIGN)
                used = self._count_valid()
                self.open_seconds = time.perf_counter() - t0
                return used
        self._create()
        self.open_seconds = time.perf_counter() - t0
        return 0

    def _read_super(self) -> tuple | None:
        raw = bytes(self._super[: _SUPER.size + 4])
        if zlib.crc32(raw[: _SUPER.size]) != int.from_bytes(raw[_SUPER.size :], "little"):
            return None
        magic, version, rec, rows, row, slot, off, epoch, alg, key, cpu_gen, seed = _SUPER.unpack(raw[: _SUPER.size])
        if magic != _SUPER_MAGIC or version != _VERSION or rec != _REC.size or alg.rstrip(b"\0") != io.DIGEST_ALG:
            return None
        return epoch, rows, row, slot, off, key, cpu_gen, seed

    def _write_super(self) -> None:
        raw = _SUPER.pack(
            _SUPER_MAGIC, _VERSION, _REC.size, self.rows, self.row_bytes, self.slot, self.data_off, self.epoch,
            io.DIGEST_ALG, self.key, self.cpu_gen, self._digest.seed,
        )  # fmt: skip
        self._super[: len(raw) + 4] = raw + zlib.crc32(raw).to_bytes(4, "little")
        io.pwrite_all(self.fd, [self._super], 0)

    def _create(self) -> None:
        os.ftruncate(self.fd, 0)
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise CacheError("disk_full", f"{self.path}: no room for {self.nbytes} bytes") from None
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self.fd, self.nbytes)  # a file system without fallocate
        self._headers[:] = bytes(len(self._headers))
        io.pwrite_all(self.fd, [self._headers], io.ALIGN)
        self.epoch = 1
        self._digest = io.RowDigest(self.row_bytes, int.from_bytes(os.urandom(8), "little"))  # this file's weights
        self._write_super()
        os.fdatasync(self.fd)

    def _count_valid(self) -> int:
        recs = torch.frombuffer(self._headers, dtype=torch.int32)[: self.rows * 8].view(self.rows, 8)
        ok = (recs[:, 0] == _REC_MAGIC) & (recs[:, 1] == torch.arange(self.rows, dtype=torch.int32))
        return int((ok & (recs[:, 2] == self.epoch)).sum())

    def invalidate(self, key: bytes | None = None) -> None:
        """Every block is gone (a clear without ``keep_cpu``, or blocks of a new layout ``key``).
        The epoch moves in memory first: even if the superblock write fails, no old row is served."""
        self.epoch, self.used, self.kept = self.epoch + 1, 0, False
        if key is not None:
            self.key = key
        try:
            if self.epoch > _MAX_EPOCH:
                self._create()
            else:
                self._write_super()
                os.fdatasync(self.fd)
        except OSError as err:
            self.stats["write_errors"] += 1
            raise CacheError("disk_io", f"disk tier superblock write failed: {err}") from None

    def set_cpu_gen(self, gen: int) -> None:
        """The bus's CPU generation is ``gen``: blocks of another one are gone for every
        client (a clear this rank missed while down, a CPU tier lost elsewhere), so
        they stop counting (a new epoch) and new blocks belong to ``gen``."""
        if gen != self.cpu_gen:
            self.cpu_gen = gen
            self.invalidate()

    def close(self) -> None:
        if self.fd >= 0:
            self._pool.close()
            os.close(self.fd)  # releases the flock
            self.fd = -1

    # --- records --------------------------------------------------------------------

    def digest_of(self, row: int) -> bytes | None:
        """The stored digest of a row, or None if the row holds no block of this epoch."""
        magic, r, epoch, crc, digest = _REC.unpack_from(self._headers, row * _REC.size)
        if magic != _REC_MAGIC or r != row or epoch != self.epoch:
            return None
        if crc != zlib.crc32(_REC_HEAD.pack(magic, r, epoch) + digest):
            return None
        return digest

    def _set_record(self, row: int, digest: bytes) -> None:
        crc = zlib.crc32(_REC_HEAD.pack(_REC_MAGIC, row, self.epoch) + digest)
        _REC.pack_into(self._headers, row * _REC.size, _REC_MAGIC, row, self.epoch, crc, digest)

    def _write_header_pages(self, rows: Sequence[int]) -> None:
        pages = sorted({r * _REC.size // io.ALIGN for r in rows})
        view = memoryview(self._headers)
        for a, b in io.runs(pages, 1 << 16):
            lo, hi = pages[a] * io.ALIGN, (pages[b - 1] + 1) * io.ALIGN
            io.pwrite_all(self.fd, [view[lo:hi]], io.ALIGN + lo)

    # --- blocks ---------------------------------------------------------------------

    def _zero_copy(self, addresses: Sequence[int], span: int) -> bool:
        """Whether rows go straight between memory and the file: always with buffered I/O;
        with O_DIRECT when every address is aligned and owns a whole slot (``span``, the
        CPU tier's row stride: its rows are page-aligned, cpu_tier.py)."""
        if not self.direct:
            return True
        return (self.slot == self.row_bytes or span >= self.slot) and all(a % io.ALIGN == 0 for a in addresses)

    def _plan(self, ids: Sequence[int], addresses: Sequence[int]) -> tuple[list[int], list[int], list]:
        """Rows in file order with their addresses, cut into pieces of consecutive rows
        (``PIECE`` bytes at most) for the pool's threads."""
        order = sorted(range(len(ids)), key=ids.__getitem__)
        rows = [ids[i] for i in order]
        return rows, [addresses[i] for i in order], io.runs(rows, max(1, io.PIECE // self.slot))

    def _iovecs(self, addrs: Sequence[int], a: int, b: int, bounce) -> list:
        """One buffer per run of rows that lie back to back in memory (``slot`` bytes each),
        or the bounce buffer."""
        if bounce is not None:
            return [memoryview(bounce)[: (b - a) * self.slot]]
        out, start, n = [], addrs[a], self.slot
        for i in range(a + 1, b):
            if addrs[i] == start + n:
                n += self.slot
            else:
                out.append(io.view_at(start, n))
                start, n = addrs[i], self.slot
        out.append(io.view_at(start, n))
        return out

    def write(self, dst: Sequence[int], addresses: Sequence[int], span: int = 0) -> int:
        """Store the ``row_bytes`` at ``addresses[i]`` as disk block ``dst[i]`` (unique ids, in
        range) with their digests; return once they are on the device (``fdatasync``).
        ``span``: bytes each address may be read (the CPU tier's row stride)."""
        rows, addrs, parts = self._plan(dst, addresses)
        zero = self._zero_copy(addrs, span)
        digests: list[bytes] = [b""] * len(rows)

        def part(share: list[tuple[int, int]]) -> list[int]:
            bounce = None if zero else self._bounce()
            for a, b in share:  # digests of a piece, then its write: one thread's I/O beside another's digests
                digests[a:b] = self._digest.of(addrs[a:b])
                if bounce is not None:
                    base = io.address_of(bounce)
                    for k in range(a, b):
                        io.ctypes.memmove(base + (k - a) * self.slot, addrs[k], self.row_bytes)
                io.pwrite_all(self.fd, self._iovecs(addrs, a, b, bounce), self.data_off + rows[a] * self.slot)
            return []

        try:
            self._pool.map(part, parts, len(rows))
            for r, digest in zip(rows, digests):
                if self.digest_of(r) is None:
                    self.used += 1
                self._set_record(r, digest)
            self._write_header_pages(rows)  # every header page of the batch, then one fdatasync
            os.fdatasync(self.fd)
        except OSError as err:
            self.stats["write_errors"] += 1
            raise CacheError("disk_io", f"disk tier write failed: {err}") from None
        return len(rows) * self.row_bytes

    def _bounce(self):
        """This thread's aligned bounce buffer (kept: a fresh one faults its pages in per call)."""
        me = threading.get_ident()
        buf = self._bounces.get(me)
        if buf is None:
            buf = self._bounces[me] = io.aligned(max(1, io.PIECE // self.slot) * self.slot)
        return buf

    def read(self, src: Sequence[int], addresses: Sequence[int], span: int = 0) -> int:
        """Read disk block ``src[i]`` into the ``row_bytes`` at ``addresses[i]`` and check
        its digest; ``DiskLost`` names every block that failed (their destinations hold
        garbage) or held nothing.  ``span``: bytes each address may be written (its row
        stride: a direct read fills a whole slot)."""
        empty = self.empty(src)
        if empty:
            raise DiskLost.empty(empty)
        bad = self.read_rows(src, addresses, span)
        if bad:
            raise DiskLost.torn(bad)
        return len(src) * self.row_bytes

    def empty(self, src: Sequence[int]) -> list[int]:
        """The rows of ``src`` that hold no block of this epoch, sorted."""
        return sorted({r for r in src if self.digest_of(r) is None})

    def read_rows(self, src: Sequence[int], addresses: Sequence[int], span: int = 0) -> list[int]:
        """``read`` of rows that hold a block, for reads of several tasks in one pass (rows
        back to back on both sides are one ``preadv``): the rows that failed their digest
        check (sorted; their destinations hold garbage), where ``read`` raises."""
        rows, addrs, parts = self._plan(src, addresses)
        zero = self._zero_copy(addrs, span)

        def part(share: list[tuple[int, int]]) -> list[int]:
            bad = []
            bounce = None if zero else self._bounce()
            for a, b in share:  # a piece's read, then its digests: one thread's I/O beside another's digests
                io.pread_all(self.fd, self._iovecs(addrs, a, b, bounce), self.data_off + rows[a] * self.slot)
                if bounce is not None:
                    base = io.address_of(bounce)
                    for k in range(a, b):
                        io.ctypes.memmove(addrs[k], base + (k - a) * self.slot, self.row_bytes)
                for i, digest in zip(range(a, b), self._digest.of(addrs[a:b])):
                    if digest != self.digest_of(rows[i]):
                        bad.append(rows[i])
            return bad

        try:
            bad = sorted(set(self._pool.map(part, parts, len(rows))))
        except OSError as err:
            self.stats["read_errors"] += 1
            raise CacheError("disk_io", f"disk tier read failed: {err}") from None
        self.stats["digest_failures"] += len(bad)
        return bad

    def checksum(self, src: Sequence[int]) -> list[bytes]:
        """The checksum digest (docs/protocol.md §6.1, BLAKE2b-16) of each block, read
        back and checked against its stored digest first (``DiskLost`` if it fails)."""
        out: list[bytes] = []
        per = max(1, io.PIECE // self.slot)
        scratch = io.aligned(per * self.slot)
        base = io.address_of(scratch)
        try:
            for i in range(0, len(src), per):
                chunk = src[i : i + per]
                addrs = [base + k * self.slot for k in range(len(chunk))]
                self.read(chunk, addrs, self.slot)
                view = memoryview(scratch)
                for a in addrs:
                    out.append(hashlib.blake2b(view[a - base : a - base + self.row_bytes], digest_size=16).digest())
                view.release()
        finally:
            scratch.close()
        return out

    def to_stats(self) -> dict[str, object]:
        return {
            "blocks": self.rows,
            "used": self.used,
            "bytes": self.nbytes,
            "direct": self.direct,
            "reopened": self.reopened,  # blocks found at open
            "kept": self.kept,  # some of them still served (no clear without keep_cpu since)
            "cpu_gen": self.cpu_gen,
            **self.stats,
        }


def _names(rows: Sequence[int]) -> str:
    shown = ",".join(str(r) for r in rows[:32])
    return shown + (f" (+{len(rows) - 32} more)" if len(rows) > 32 else "")
