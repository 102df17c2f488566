"""The copy engine between an engine's regions and zkv's CPU tier.

``swap_out(blocks -> rows)`` and ``swap_in(rows -> blocks)`` sort the id
pairs and coalesce runs of consecutive (src, dst) into one slice copy per
region: no index tensors, no ``index_put_`` temporaries (FIELD-NOTES
"Speed"); on CPU a short run is a ``memmove`` per row (``_copy_rows_cpu``).
On CUDA a run becomes one contiguous transfer to or from the pinned tier
through a device staging buffer; the copies go on a copy stream that first waits for the engine's compute stream (or for an event the
engine passed with the task), and a swap returns only after a CUDA event
recorded behind the last copy has completed: a caller may report ``ok``
the moment it returns, and the engine may read a swap-in's blocks then.

Ordering the engine must keep (docs/engines.md): submit a swap-out only for
blocks it has finished writing; do not touch a swap-in's destination
blocks until its outcome is ``ok``."""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

from .errors import CacheError
from .regions import EngineCache, check_ids
from .tier import CpuTier


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge id pairs into runs ``(src_start, dst_start, length)``."""
    runs: list[tuple[int, int, int]] = []
    s0 = d0 = length = 0
    for s, d in sorted(zip(src, dst)):
        if length and s == s0 + length and d == d0 + length:
            length += 1
            continue
        if length:
            runs.append((s0, d0, length))
        s0, d0, length = s, d, 1
    if length:
        runs.append((s0, d0, length))
    return runs


# A run at least this long is one torch slice copy (torch may split it over
# threads); a shorter one is a memmove per row, which costs ~0.3 us of Python
# instead of ~10 us for two slices and a copy_ (measured: 256 scattered
# 16 KiB pages x 8 regions, 0.3x -> 0.7x of one contiguous copy_).
SLICE_COPY_MIN_ROWS = 8


def _copy_rows_cpu(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """Copy rows of two CPU ``[rows, page]`` uint8 views (row-contiguous, ids already range-checked)."""
    page = src.shape[1]
    sp, ss, dp, ds = src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0)
    memmove = ctypes.memmove
    for s, d, n in runs:
        if n >= SLICE_COPY_MIN_ROWS:
            dst[d:d + n].copy_(src[s:s + n])
        elif ss == ds == page:
            memmove(dp + d * ds, sp + s * ss, n * page)
        else:
            for i in range(n):
                memmove(dp + (d + i) * ds, sp + (s + i) * ss, page)


# CUDA staging: how many bytes of device memory the copy engine may use to turn
# a run of blocks into one contiguous host transfer (the only device memory
# zkv allocates; dropped by close()).
STAGING_BYTES = 32 << 20


def _chunks(runs: list[tuple[int, int, int]], limit: int) -> list[tuple[int, int, int]]:
    """Split runs longer than ``limit`` rows."""
    out = []
    for s, d, n in runs:
        for k in range(0, n, limit):
            out.append((s + k, d + k, min(limit, n - k)))
    return out


class CopyEngine:
    """Block copies for one attached cache and one tier (one thread drives it).

    On CUDA a run is gathered, region by region, into a device staging
    buffer laid out like tier rows, then moved in one contiguous transfer to
    the pinned tier (and the reverse for swap-in); a one-region cache whose
    pages are adjacent copies directly.  Every copy is ``non_blocking`` on
    ``copy_stream``."""

    def __init__(self, cache: EngineCache, tier: CpuTier, compute_stream: Any = None,
                 staging_bytes: int = STAGING_BYTES):
        if not tier.fits(cache.descriptor):
            raise CacheError("bad_layout", "the CPU tier's rows do not match the cache's regions (page shape differs)")
        self.cache = cache
        self.tier = tier
        self.cuda = cache.device.type == "cuda"
        self.compute_stream = compute_stream
        self.copy_stream = torch.cuda.Stream(device=cache.device) if self.cuda else None
        self.staging_rows = max(1, staging_bytes // tier.row_bytes)
        self._staging: torch.Tensor | None = None
        self._spans, start = [], 0
        for _, page in tier.page_shape:
            self._spans.append((start, start + page))
            start += page

    def close(self) -> None:
        """Drop the device staging buffer (call on clear, with ``cache.release()``)."""
        self._staging = None

    def swap_out(self, src_blocks: Sequence[int], dst_rows: Sequence[int], wait_event: Any = None) -> int:
        """Copy engine blocks into tier rows; return bytes moved once the bytes are there."""
        self._check(src_blocks, dst_rows)
        self.cache.check_ids("src", src_blocks, unique=False)
        check_ids("dst", dst_rows, self.tier.rows, "cpu", unique=True)
        runs = coalesce(src_blocks, dst_rows)
        if self.cuda:
            self._on_copy_stream(lambda: self._out_cuda(runs), wait_event)
        else:
            for view, column in zip(self.cache.views, self.tier.columns):
                _copy_rows_cpu(view, column, runs)
        return len(src_blocks) * self.cache.descriptor.block_bytes

    def swap_in(self, src_rows: Sequence[int], dst_blocks: Sequence[int], wait_event: Any = None) -> int:
        """Copy tier rows into engine blocks; return bytes moved once the bytes are there."""
        self._check(src_rows, dst_blocks)
        check_ids("src", src_rows, self.tier.rows, "cpu", unique=False)
        self.cache.check_ids("dst", dst_blocks, unique=True)
        runs = coalesce(src_rows, dst_blocks)
        if self.cuda:
            self._on_copy_stream(lambda: self._in_cuda(runs), wait_event)
        else:
            for column, view in zip(self.tier.columns, self.cache.views):
                _copy_rows_cpu(column, view, runs)
        return len(src_rows) * self.cache.descriptor.block_bytes

    def _check(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if self.cache.released:
            raise CacheError("released", "the engine cache was released (cleared); attach a new generation")
        if len(src) != len(dst) or not src:
            raise CacheError("bad_block_id", f"src and dst must be equally long and non-empty ({len(src)} vs {len(dst)})")

    # --- CUDA ------------------------------------------------------------------

    def _on_copy_stream(self, enqueue: Any, wait_event: Any) -> None:
        """Order after the engine, enqueue the copies, return when they completed."""
        stream = self.copy_stream
        assert stream is not None
        if wait_event is not None:
            stream.wait_event(wait_event)
        else:
            stream.wait_stream(self.compute_stream or torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            enqueue()
            done = torch.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning a core
            done.record(stream)
        done.synchronize()

    def _direct(self) -> torch.Tensor | None:
        """The one region's view when it can be copied without staging."""
        views = self.cache.views
        return views[0] if len(views) == 1 and views[0].is_contiguous() else None

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty((self.staging_rows, self.tier.row_bytes), dtype=torch.uint8, device=self.cache.device)
        return self._staging

    def _out_cuda(self, runs: list[tuple[int, int, int]]) -> None:
        store, direct = self.tier.store, self._direct()
        if direct is not None:
            for s, d, n in runs:
                store[d:d + n].copy_(direct[s:s + n], non_blocking=True)
            return
        staging = self._staging_buffer()
        for s, d, n in _chunks(runs, self.staging_rows):
            for view, (a, b) in zip(self.cache.views, self._spans):
                staging[:n, a:b].copy_(view[s:s + n], non_blocking=True)
            store[d:d + n].copy_(staging[:n], non_blocking=True)

    def _in_cuda(self, runs: list[tuple[int, int, int]]) -> None:
        store, direct = self.tier.store, self._direct()
        if direct is not None:
            for s, d, n in runs:
                direct[d:d + n].copy_(store[s:s + n], non_blocking=True)
            return
        staging = self._staging_buffer()
        for s, d, n in _chunks(runs, self.staging_rows):
            staging[:n].copy_(store[s:s + n], non_blocking=True)
            for view, (a, b) in zip(self.cache.views, self._spans):
                view[d:d + n].copy_(staging[:n, a:b], non_blocking=True)
