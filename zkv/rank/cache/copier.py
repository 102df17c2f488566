"""The copy engine between an engine's regions and zkv's CPU tier.

``swap_out(blocks -> rows)`` and ``swap_in(rows -> blocks)`` sort the id
pairs and coalesce runs of consecutive (src, dst) into one slice copy per
region: no index tensors, no ``index_put_`` temporaries (FIELD-NOTES
"Speed"); on CPU a short run is a ``memmove`` per row (``_copy_rows_cpu``).  On CUDA the copies go on the engine cache's own copy stream,
which first waits for the engine's compute stream (or for an event the
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


class CopyEngine:
    """Block copies for one attached cache and one tier (one thread drives it)."""

    def __init__(self, cache: EngineCache, tier: CpuTier, compute_stream: Any = None):
        if not tier.fits(cache.descriptor):
            raise CacheError("bad_layout", "the CPU tier's rows do not match the cache's regions (page shape differs)")
        self.cache = cache
        self.tier = tier
        self.cuda = cache.device.type == "cuda"
        self.compute_stream = compute_stream
        self.copy_stream = torch.cuda.Stream(device=cache.device) if self.cuda else None

    def swap_out(self, src_blocks: Sequence[int], dst_rows: Sequence[int], wait_event: Any = None) -> int:
        """Copy engine blocks into tier rows; return bytes moved."""
        self._check(src_blocks, dst_rows)
        self.cache.check_ids("src", src_blocks, unique=False)
        check_ids("dst", dst_rows, self.tier.rows, "cpu", unique=True)
        return self._copy(self.cache.views, self.tier.columns, coalesce(src_blocks, dst_rows), len(src_blocks), wait_event)

    def swap_in(self, src_rows: Sequence[int], dst_blocks: Sequence[int], wait_event: Any = None) -> int:
        """Copy tier rows into engine blocks; return bytes moved once the bytes are there."""
        self._check(src_rows, dst_blocks)
        check_ids("src", src_rows, self.tier.rows, "cpu", unique=False)
        self.cache.check_ids("dst", dst_blocks, unique=True)
        return self._copy(self.tier.columns, self.cache.views, coalesce(src_rows, dst_blocks), len(src_rows), wait_event)

    def _check(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if self.cache.released:
            raise CacheError("released", "the engine cache was released (cleared); attach a new generation")
        if len(src) != len(dst) or not src:
            raise CacheError("bad_block_id", f"src and dst must be equally long and non-empty ({len(src)} vs {len(dst)})")

    def _copy(self, src_views: list[torch.Tensor], dst_views: list[torch.Tensor], runs: list[tuple[int, int, int]],
              blocks: int, wait_event: Any) -> int:
        if not self.cuda:
            for sv, dv in zip(src_views, dst_views):
                _copy_rows_cpu(sv, dv, runs)
            return blocks * self.cache.descriptor.block_bytes
        stream = self.copy_stream
        assert stream is not None
        if wait_event is not None:
            stream.wait_event(wait_event)
        else:
            stream.wait_stream(self.compute_stream or torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for sv, dv in zip(src_views, dst_views):
                for s, d, n in runs:
                    dv[d:d + n].copy_(sv[s:s + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return blocks * self.cache.descriptor.block_bytes
