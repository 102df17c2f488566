"""zkv's CPU tier: block-major, one contiguous row per block holding that
block's page of every region, in region order (the shape a disk or remote
tier can take whole).  Pinned when CUDA exists, so copies to and from the
GPU can be asynchronous.  Both caches use it: zkv's own and an engine's.

The tier belongs to zkv, not the engine.  It can outlive an engine cache
across a clear (``keep_cpu``) when the next cache has the same page shape
(``fits``); its rows are then still valid blocks of the same regions.

With a ``place`` it also outlives the rank process: its rows live in a tier
file (``tier_file.TierFile``, ``/dev/shm``) that a restarted rank maps again
(``kept``); every row written is sealed with its digest after its bytes, and
every row read is checked first (``check_rows``): a block whose header or
digest does not check is lost, never served.  Without one it is process
memory, gone with the process.

Either way a row is served only if it was written in the tier's current CPU
generation (docs/protocol.md §8.2): a row never written, or written before
the generation moved, holds nothing and reads as lost (``lost_block`` naming
it), never as zeros.  Which rows are sealed is the tier's ``seals``, one
interface (``RowSeals``) with two keepers: a tier file keeps them in its row
headers (``tier_file.TierFile``), a tier in process memory as one flag per
row (``MemorySeals``); the tier's read and write rules are written once, on
top of either.

The store calls a CPU tier and the disk tier (``disk_tier.DiskTier``) through
the same few members (``HostTier``): their size, ``set_cpu_gen``,
``checksum`` and ``close``.

Rows start page-aligned, in memory as in a tier file (``tier_file.row_stride``:
a row not a multiple of a page is padded to one when that costs at most 1/16
more), so the disk tier's O_DIRECT I/O goes straight between a row and the
disk file, no bounce copy.  A pinned tier keeps its rows packed: the CUDA
staging copies move runs of rows as one contiguous transfer."""

from __future__ import annotations

import ctypes
import hashlib
from typing import Hashable, Protocol, Sequence

import numpy as np
import torch

from ..errors import CacheError
from ..memory.descriptor import CacheDescriptor
from .tier_file import ROW_ALIGN, TierFile, TierPlace, row_stride


class HostTier(Protocol):
    """What the store asks of a tier in host memory or below it (the CPU tier, the disk tier)."""

    @property
    def rows(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def set_cpu_gen(self, gen: int) -> None: ...

    def checksum(self, ids: Sequence[int]) -> list[bytes]: ...


class RowSeals(Protocol):
    """Which rows of a CPU tier hold bytes of its generation ``gen`` (``valid``), and the
    seal that says so: broken before a row is written, set after (``TierFile`` has them
    in a file, ``MemorySeals`` in process memory)."""

    gen: int
    kept: bool
    valid: np.ndarray

    def set_gen(self, gen: int) -> None: ...

    def unseal(self, rows: list[int]) -> None: ...

    def seal(self, rows: list[int], gen: int) -> None: ...

    def lost(self, rows: list[int]) -> tuple[list[int], list[int]]: ...

    def close(self, unlink: bool = False) -> None: ...


class MemorySeals:
    """The seals of a CPU tier in process memory: one flag per row written at ``gen``,
    gone with the process (nothing can tear them, so no row is ever ``torn``)."""

    kept = False

    def __init__(self, rows: int, gen: int):
        self.gen = gen
        self.valid = np.zeros(rows, dtype=bool)

    def set_gen(self, gen: int) -> None:
        if gen != self.gen:
            self.gen = gen
            self.valid[:] = False

    def unseal(self, rows: list[int]) -> None:
        self.valid[rows] = False

    def seal(self, rows: list[int], gen: int) -> None:
        self.valid[rows] = gen == self.gen

    def lost(self, rows: list[int]) -> tuple[list[int], list[int]]:
        return [int(r) for r in dict.fromkeys(rows) if not self.valid[r]], []

    def close(self, unlink: bool = False) -> None:
        pass


class CpuTier:
    """``store`` is ``[rows, row_bytes]`` uint8; ``columns[i]`` is region i's page in every row."""

    def __init__(
        self,
        page_shape: Sequence[tuple[str, int]],
        rows: int,
        pin: bool | None = None,
        *,
        place: TierPlace | None = None,
        key: Hashable = None,
        gen: int = 0,
    ):
        if type(rows) is not int or rows < 1:
            raise CacheError("bad_layout", f"a CPU tier needs at least one row, got {rows!r}")
        self.page_shape = tuple((str(name), int(page)) for name, page in page_shape)
        self.row_bytes = sum(page for _, page in self.page_shape)
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.file: TierFile | None = None
        self._registered = 0  # the pointer registered with CUDA (a mapped, pinned tier)
        self.digest_failures = 0
        self._writing_gen = gen  # the generation when the rows being written began
        self.seals: RowSeals = MemorySeals(rows, gen)
        self.stride = row_stride(self.row_bytes, pad=not self.pinned)
        if place is None:
            # zeros, not empty: every page is faulted in once here, not during the first copies
            flat = torch.zeros(rows * self.stride + ROW_ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
            at = -flat.data_ptr() % ROW_ALIGN  # the first row page-aligned (pinned memory is already)
            self.store = flat[at : at + rows * self.stride].view(rows, self.stride)[:, : self.row_bytes]
        else:
            key = (self.page_shape, rows, key)
            self.file = self.seals = TierFile(place, key, rows, self.row_bytes, gen, self.stride)
            self.store = torch.from_numpy(self.file.data)
            if not self.file.kept:
                self.store.zero_()  # fault every page in once, as above
            if self.pinned:
                ptr = self.store.data_ptr()
                err = torch.cuda.cudart().cudaHostRegister(ptr, rows * self.stride, 0)
                if int(err) != 0:
                    self.close(unlink=not self.file.kept)
                    raise CacheError("bad_layout", f"cannot pin the CPU tier mapping {place} (cuda error {err})")
                self._registered = ptr
        self.columns: list[torch.Tensor] = []
        start = 0
        for _, page in self.page_shape:
            self.columns.append(self.store[:, start : start + page])
            start += page

    @classmethod
    def for_cache(
        cls,
        descriptor: CacheDescriptor,
        rows: int,
        pin: bool | None = None,
        *,
        place: TierPlace | None = None,
        key: Hashable = None,
        gen: int = 0,
    ) -> "CpuTier":
        return cls(descriptor.page_shape, rows, pin, place=place, key=key, gen=gen)

    @property
    def rows(self) -> int:
        return self.store.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows * self.stride

    @property
    def kept(self) -> bool:
        """Mapped again from a tier file an earlier process of this rank left."""
        return self.seals.kept

    @property
    def gen(self) -> int:
        """The CPU generation the rows belong to."""
        return self.seals.gen

    def valid_rows(self) -> int:
        return int(np.count_nonzero(self.seals.valid))  # per ack: no bool->int sum

    def to_stats(self, kept: bool) -> dict[str, object]:
        """What the rank's stats say of this tier (``zkv status``, the metrics):
        ``kept`` when this process mapped it again from an earlier one's file;
        a tier file's path, the blocks whose header checks and its digests."""
        out: dict[str, object] = {"blocks": self.rows, "bytes": self.nbytes, "kept": kept}
        if self.file is not None:
            out.update(file=str(self.file.path), used=self.valid_rows(), digests=self.file.digests)
        out["digest_failures"] = self.digest_failures
        return out

    def set_cpu_gen(self, gen: int) -> None:
        """The rows now belong to CPU generation ``gen``: rows written at another one hold nothing."""
        self.seals.set_gen(gen)

    def fits(self, descriptor: CacheDescriptor) -> bool:
        """Whether this tier's rows are blocks of ``descriptor``'s regions (same names and page sizes)."""
        return descriptor.page_shape == self.page_shape

    def addresses(self, rows: Sequence[int]) -> list[int]:
        """Where each row starts in memory (the disk tier's I/O goes straight to them)."""
        base, stride = self.store.data_ptr(), self.store.stride(0)
        return [base + r * stride for r in rows]

    def row_bytes_of(self, row: int) -> bytes:
        """One row's bytes (for checks and checksums)."""
        return ctypes.string_at(self.store[row].data_ptr(), self.row_bytes)

    # --- the write and read rules (the same on either keeper of the seals) ------------

    def writing(self, rows: Sequence[int]) -> None:
        """Rows are about to be written: a kill (or a failure) from here on loses them."""
        self._writing_gen = self.seals.gen
        self.seals.unseal(list(rows))

    def written(self, rows: Sequence[int]) -> None:
        """Rows hold their new bytes: seal them (a tier file: digest, then the mark); a row
        whose write began before the generation moved holds nothing of the new one."""
        self.seals.seal(list(rows), self._writing_gen)

    def check_rows(self, rows: Sequence[int]) -> None:
        """Before rows are read: ``CacheError("lost_block")`` naming every row that
        was not written in this generation, or whose header or digest does not check."""
        empty, torn = self.seals.lost(list(rows))
        if not empty and not torn:
            return
        self.seals.valid[empty + torn] = False
        self.digest_failures += len(torn)
        said = []
        if empty:
            said.append(
                f"CPU block(s) {_some(empty)} hold nothing of CPU generation {self.seals.gen} "
                "(never written in it, or dropped by a clear or a move of the generation)"
            )
        if torn:
            said.append(f"CPU block(s) {_some(torn)} lost: header or digest does not check (torn write or corruption)")
        raise CacheError("lost_block", "; ".join(said))

    def checksum(self, ids: Sequence[int]) -> list[bytes]:
        """A 16-byte BLAKE2b digest of each row (a block's page in every region, in
        region order), a lost row failing it first (``check_rows``)."""
        self.check_rows(ids)
        known: dict[int, bytes] = {}
        for r in ids:
            if r not in known:
                known[r] = hashlib.blake2b(self.row_bytes_of(r), digest_size=16).digest()
        return [known[r] for r in ids]

    def close(self, unlink: bool = False) -> None:
        """Drop the rows; a mapped tier's file is kept for the next process unless ``unlink``."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = 0
        self.columns = []
        self.store = torch.zeros((0, self.row_bytes), dtype=torch.uint8)
        self.seals.close(unlink)


def _some(rows: list[int]) -> str:
    """The first 16 rows, and how many more."""
    more = f" and {len(rows) - 16} more" if len(rows) > 16 else ""
    return f"{rows[:16]}{more}"
