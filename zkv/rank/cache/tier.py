"""zkv's CPU tier for an engine-attached cache: block-major, one contiguous
row per block holding that block's page of every region, in region order
(the shape a disk or remote tier can take whole).  Pinned when CUDA exists,
so copies to and from the GPU can be asynchronous.

The tier belongs to zkv, not the engine.  It can outlive an engine cache
across a clear (``keep_cpu``) when the next cache has the same page shape
(``fits``); its rows are then still valid blocks of the same regions."""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from .descriptor import CacheDescriptor
from .errors import CacheError


class CpuTier:
    """``store`` is ``[rows, row_bytes]`` uint8; ``columns[i]`` is region i's page in every row."""

    def __init__(self, page_shape: Sequence[tuple[str, int]], rows: int, pin: bool | None = None):
        if type(rows) is not int or rows < 1:
            raise CacheError("bad_layout", f"a CPU tier needs at least one row, got {rows!r}")
        self.page_shape = tuple((str(name), int(page)) for name, page in page_shape)
        self.row_bytes = sum(page for _, page in self.page_shape)
        self.pinned = torch.cuda.is_available() if pin is None else pin
        # zeros, not empty: every page is faulted in once here, not during the first copies
        self.store = torch.zeros((rows, self.row_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        self.columns: list[torch.Tensor] = []
        start = 0
        for _, page in self.page_shape:
            self.columns.append(self.store[:, start : start + page])
            start += page

    @classmethod
    def for_cache(cls, descriptor: CacheDescriptor, rows: int, pin: bool | None = None) -> "CpuTier":
        return cls(descriptor.page_shape, rows, pin)

    @property
    def rows(self) -> int:
        return self.store.shape[0]

    @property
    def nbytes(self) -> int:
        return self.store.numel()

    def fits(self, descriptor: CacheDescriptor) -> bool:
        """Whether this tier's rows are blocks of ``descriptor``'s regions (same names and page sizes)."""
        return descriptor.page_shape == self.page_shape

    def row_bytes_of(self, row: int) -> bytes:
        """One row's bytes (for checks and checksums)."""
        return ctypes.string_at(self.store[row].data_ptr(), self.row_bytes)
