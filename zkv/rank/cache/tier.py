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
it), never as zeros.  A tier file keeps that in its row headers; a tier in
process memory keeps one flag per row (``_written``).

Rows start page-aligned, in memory as in a tier file (``tier_file.row_stride``:
a row not a multiple of a page is padded to one when that costs at most 1/16
more), so the disk tier's O_DIRECT I/O goes straight between a row and the
disk file, no bounce copy.  A pinned tier keeps its rows packed: the CUDA
staging copies move runs of rows as one contiguous transfer."""

from __future__ import annotations

import ctypes
from typing import Hashable, Sequence

import numpy as np
import torch

from ..tier_file import ROW_ALIGN, TierFile, TierPlace, row_stride
from .descriptor import CacheDescriptor
from .errors import CacheError


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
        self._writing_gen = gen
        self._gen = gen  # a tier in process memory: the generation its written rows belong to
        self._written = np.zeros(rows, dtype=bool)  # a tier in process memory: rows written at ``_gen``
        self.stride = row_stride(self.row_bytes, pad=not self.pinned)
        if place is None:
            # zeros, not empty: every page is faulted in once here, not during the first copies
            flat = torch.zeros(rows * self.stride + ROW_ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
            at = -flat.data_ptr() % ROW_ALIGN  # the first row page-aligned (pinned memory is already)
            self.store = flat[at : at + rows * self.stride].view(rows, self.stride)[:, : self.row_bytes]
        else:
            self.file = TierFile(place, (self.page_shape, rows, key), rows, self.row_bytes, gen, self.stride)
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
        return self.file is not None and self.file.kept

    @property
    def gen(self) -> int | None:
        """The CPU generation the rows belong to (None: process memory, no record)."""
        return self.file.gen if self.file is not None else None

    def valid_rows(self) -> int:
        rows = self.file.valid if self.file is not None else self._written
        return int(np.count_nonzero(rows))  # per ack: no bool->int sum

    def to_stats(self, kept: bool) -> dict[str, object]:
        """What the rank's stats say of this tier (``zkv status``, the metrics):
        ``kept`` when this process mapped it again from an earlier one's file;
        a tier file's path, the blocks whose header checks and its digests."""
        out: dict[str, object] = {"blocks": self.rows, "bytes": self.nbytes, "kept": kept}
        if self.file is not None:
            out.update(file=str(self.file.path), used=self.valid_rows(), digests=self.file.digests)
        out["digest_failures"] = self.digest_failures
        return out

    def set_gen(self, gen: int) -> None:
        """The rows now belong to CPU generation ``gen``: rows written at another one hold nothing."""
        if self.file is not None:
            self.file.set_gen(gen)
        elif gen != self._gen:
            self._gen = gen
            self._written[:] = False

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

    # --- the write and read rules of a mapped tier ---------------------------------

    def writing(self, rows: Sequence[int]) -> None:
        """Rows are about to be written: a kill (or a failure) from here on loses them."""
        if self.file is not None:
            self._writing_gen = self.file.gen
            self.file.unseal(list(rows))
        else:
            self._writing_gen = self._gen
            self._written[list(rows)] = False

    def written(self, rows: Sequence[int]) -> None:
        """Rows hold their new bytes: seal them (digest, then the mark); a row whose
        write began before the generation moved holds nothing of the new one."""
        if self.file is not None:
            self.file.seal(list(rows), self._writing_gen)
        else:
            self._written[list(rows)] = self._writing_gen == self._gen

    def check_rows(self, rows: Sequence[int]) -> None:
        """Before rows are read: ``CacheError("lost_block")`` naming every row that
        was not written in this generation, or whose header or digest does not check."""
        if self.file is not None:
            empty, torn = self.file.lost(list(rows))
            self.file.valid[empty + torn] = False
        else:
            empty = [int(r) for r in dict.fromkeys(rows) if not self._written[r]]
            torn = []
        if not empty and not torn:
            return
        self.digest_failures += len(torn)
        said = []
        if empty:
            gen = self.gen if self.file is not None else self._gen
            said.append(
                f"CPU block(s) {_some(empty)} hold nothing of CPU generation {gen} "
                "(never written in it, or dropped by a clear or a move of the generation)"
            )
        if torn:
            said.append(f"CPU block(s) {_some(torn)} lost: header or digest does not check (torn write or corruption)")
        raise CacheError("lost_block", "; ".join(said))

    def close(self, unlink: bool = False) -> None:
        """Drop the rows; a mapped tier's file is kept for the next process unless ``unlink``."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = 0
        self.columns = []
        self.store = torch.zeros((0, self.row_bytes), dtype=torch.uint8)
        if self.file is not None:
            self.file.close(unlink)


def _some(rows: list[int]) -> str:
    """The first 16 rows, and how many more."""
    more = f" and {len(rows) - 16} more" if len(rows) > 16 else ""
    return f"{rows[:16]}{more}"
