"""The disk tier's plumbing: the O_DIRECT probe, aligned buffers and batched
positional I/O (``os.preadv`` / ``os.pwritev``) with the block digest.

O_DIRECT bypasses the page cache, so a spilled block does not also take host
memory and a read comes from the device; some file systems refuse it with
``EINVAL`` (overlayfs behind a container's ``/tmp``, older tmpfs, some NFS),
so it is probed once per directory and the tier falls back to buffered I/O
(both end a write batch with ``fdatasync``).  Direct I/O needs every buffer
address, length and file offset aligned (``ALIGN``): rows that are not go
through an aligned bounce buffer.

The digest of a disk row (``RowDigest``, ``mh64`` in the file's superblock)
is a multilinear hash: the row's little-endian 64-bit words ``x_i``, summed
as ``sum(w_i * x_i) mod 2^64`` with odd 64-bit weights drawn from a seed the
file keeps (splitmix64: the same on every machine).  It guards what can
happen to a block on its way to the device and back: a write torn by a kill
or a power cut (some sectors new, some old), a header that reached the
device before its row (the slot's old bytes), a misdirected or rotted
sector.  A change confined to one word is always caught (an odd weight
times a nonzero difference is nonzero mod 2^64); one spread over several
words is missed with odds 2^-(64-v) over the seed, where v is the lowest
bit in which any changed word differs from what was stored: about 2^-64
for KV data, whose low mantissa bits differ between any two blocks (and
between a block and zeros), at most 2^-32 unless every changed word keeps
its low 32 bits.  The record beside the row (row id, epoch, its own
CRC-32) rules out another slot's block or one of a dropped epoch.  It is no
guard against someone who writes the file on purpose (the seed is in it):
the file is the rank's own, mode 0600.  It costs one pass of numpy's
``einsum`` over the row: about 8 GB/s from memory on one core here, where
CRC-32 (zlib) ran at 2.7 and SHA-256 at 1.4, against O_DIRECT reads of 0.5
to 3 GB/s; it releases the GIL, so the pool's threads check one piece
(``PIECE``) while another's I/O runs."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

ALIGN = 4096  # covers 512- and 4096-byte logical blocks
IOV_MAX = 1024  # Linux's limit on buffers per preadv / pwritev
DIGEST_ALG = b"mh64"
PIECE = 4 << 20  # bytes one pool thread reads or writes at a time: others check digests meanwhile

_probed: dict[str, bool] = {}
_probe_lock = threading.Lock()


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


_MASK = (1 << 64) - 1
_PAD = bytes(8)


def mh64_weights(seed: int, n: int) -> np.ndarray:
    """``n`` odd 64-bit weights from ``seed`` (splitmix64, as int64: numpy wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed & _MASK)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z | np.uint64(1)).view(np.int64)


class RowDigest:
    """The digest of rows of ``row_bytes`` for one seed (the module docstring): 8 bytes of
    hash, little-endian, in the record's 16.  A row's last ``row_bytes % 8`` bytes count
    as one more word, zero-padded."""

    def __init__(self, row_bytes: int, seed: int):
        self.seed = seed
        self.words, self.tail = divmod(row_bytes, 8)
        w = mh64_weights(seed, self.words + 1)
        self.w, self.w_tail = w[: self.words], int(w[self.words]) & _MASK

    def of(self, addresses: Sequence[int]) -> list[bytes]:
        """The digests of the rows at ``addresses``: one numpy pass per run of evenly spaced rows."""
        out: list[bytes] = []
        i, n = 0, len(addresses)
        while i < n:
            step = addresses[i + 1] - addresses[i] if i + 1 < n else 0
            j = i + 1
            while j < n and step >= 0 and addresses[j] - addresses[j - 1] == step:
                j += 1
            run = self._run(addresses[i], j - i, step)
            if self.tail:
                run = [self._with_tail(d, a) for d, a in zip(run, addresses[i:j])]
            out += run
            i = j
        return out

    def _run(self, first: int, n: int, step: int) -> list[bytes]:
        """Rows ``first + k * step`` (k < n), as one ``[n, words]`` view of the memory."""
        if self.words == 0:
            return [bytes(16)] * n
        span = (n - 1) * step + self.words * 8
        x = np.ndarray((n, self.words), np.int64, memoryview((ctypes.c_ubyte * span).from_address(first)), 0, (step, 8))
        with np.errstate(over="ignore"):
            hashes = np.einsum("ij,j->i", x, self.w)
        return [int(h).to_bytes(8, "little", signed=True) + _PAD for h in hashes]

    def _with_tail(self, digest: bytes, address: int) -> bytes:
        last = int.from_bytes(ctypes.string_at(address + self.words * 8, self.tail), "little")
        h = (int.from_bytes(digest[:8], "little") + self.w_tail * last) & _MASK
        return h.to_bytes(8, "little") + _PAD


def aligned(nbytes: int) -> mmap.mmap:
    """Zeroed, page-aligned memory (an anonymous mapping) of at least ``nbytes``."""
    return mmap.mmap(-1, max(ALIGN, align_up(nbytes)))


def view_at(address: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` of memory at ``address`` (a tensor's row): no copy."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def address_of(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_ubyte.from_buffer(buf))


def direct_supported(directory: str) -> bool:
    """Whether files in ``directory`` take O_DIRECT: probed once per directory
    by writing and reading one aligned page of a scratch file."""
    key = os.path.realpath(directory)
    with _probe_lock:
        if key not in _probed:
            _probed[key] = _probe(key)
        return _probed[key]


def _probe(directory: str) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".zkv-direct-probe-{os.getpid()}-{threading.get_ident()}")
    buf = aligned(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    try:
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


def pwrite_all(fd: int, bufs: Sequence[memoryview | mmap.mmap], offset: int) -> None:
    """Write every buffer in order from ``offset`` (short writes continued)."""
    for i in range(0, len(bufs), IOV_MAX):
        chunk = list(bufs[i : i + IOV_MAX])
        want = sum(len(b) for b in chunk)
        done = os.pwritev(fd, chunk, offset)
        if done != want:
            rest = b"".join(bytes(b) for b in chunk)[done:]  # rare (a signal, a full disk): finish plainly
            while rest:
                n = os.pwrite(fd, rest, offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short write to the disk tier")
                done, rest = done + n, rest[n:]
        offset += want


def pread_all(fd: int, bufs: Sequence[memoryview | mmap.mmap], offset: int) -> None:
    """Fill every buffer in order from ``offset``; a short read (past the end) is an error."""
    for i in range(0, len(bufs), IOV_MAX):
        chunk = list(bufs[i : i + IOV_MAX])
        want = sum(len(b) for b in chunk)
        got = os.preadv(fd, chunk, offset)
        if got != want:
            raise OSError(errno.EIO, f"short read from the disk tier ({got} of {want} bytes at {offset})")
        offset += want


def runs(rows: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Positions ``(start, end)`` into ``rows`` where the rows are consecutive, at most ``limit`` long."""
    out = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1 or i - start >= limit:
            out.append((start, i))
            start = i
    return out


class IOPool:
    """A few threads that share out the runs of a big batch (hash and I/O in
    parallel); a small batch runs on the caller's thread."""

    def __init__(self, threads: int = 2, min_rows: int = 8):
        self.threads = threads
        self.min_rows = min_rows
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[list[tuple[int, int]]], list[int]], parts: list[tuple[int, int]], rows: int) -> list:
        """Run ``fn`` over slices of ``parts``; return the concatenated lists it returns."""
        if self.threads <= 1 or rows < self.min_rows or len(parts) < 2:
            return fn(parts)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="zkv-disk")
        n = min(self.threads, len(parts))
        shares = [parts[i::n] for i in range(n)]
        out: list[int] = []
        for res in list(self._pool.map(fn, shares)):
            out += res
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
