"""The copy engine between an engine's regions and zkv's CPU tier.

``swap_out(blocks -> rows)`` and ``swap_in(rows -> blocks)`` sort the id
pairs and coalesce runs of consecutive (src, dst) into one slice copy per
region: no index tensors, no ``index_put_`` temporaries (each costs a fresh
buffer and its page faults); on CPU a short run is a ``memmove`` per row (``_copy_rows_cpu``).
On CUDA (``staging``) the pairs are gathered on the device into staging
buffers laid out like tier rows and cross the link in one contiguous
transfer per chunk to or from the pinned tier: no host-side scatter, no
allocation per task.  The copies go on streams that first wait for the
engine's compute stream (or for an event the engine passed with the task),
and a swap returns only after a CUDA event recorded behind the last copy
has completed: a caller may report ``ok``
the moment it returns, and the engine may read a swap-in's blocks then.

Ordering the engine must keep (docs/engines.md): submit a swap-out only for
blocks it has finished writing; do not touch a swap-in's destination
blocks until its outcome is ``ok``."""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np
import torch

from .errors import CacheError
from .regions import EngineCache, check_ids
from .staging import STAGING_BYTES, StagedCopier, group_regions
from .tier import CpuTier


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge id pairs into runs ``(src_start, dst_start, length)``."""
    if len(src) == 1:  # the common small swap
        return [(src[0], dst[0], 1)]
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
            dst[d : d + n].copy_(src[s : s + n])
        elif ss == ds == page:
            memmove(dp + d * ds, sp + s * ss, n * page)
        else:
            for i in range(n):
                memmove(dp + (d + i) * ds, sp + (s + i) * ss, page)


CpuGroup = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], Any, Any]


def _copy_groups_cpu(groups: list[CpuGroup], runs: list[tuple[int, int, int]], out: bool) -> None:
    """Per group of equally spaced regions of one buffer (``staging.group_regions``): a run that
    moves at least SLICE_COPY_MIN_ROWS pages is one strided copy for the whole group (zkv's own
    store: every layer's K and V at once); the others go region by region (``_copy_rows_cpu``).
    The strided copy is numpy's ``copyto`` on views of the same memory: ~3 us for one block of
    8 pages where torch's ``copy_`` takes ~15 us to set up its iterator (profiled:
    a quarter of a rank's time on 1-block tasks); for long runs both stream at memory speed."""
    for _, _, views, columns, engine_np, tier_np in groups:
        count, rest = engine_np.shape[0], []
        for s, d, n in runs:
            if count == 1 or n * count < SLICE_COPY_MIN_ROWS:
                rest.append((s, d, n))
            elif out:
                np.copyto(tier_np[d : d + n], engine_np[:, s : s + n].transpose(1, 0, 2))
            else:
                np.copyto(engine_np[:, d : d + n], tier_np[s : s + n].transpose(1, 0, 2))
        for view, column in zip(views, columns) if rest else ():
            if out:
                _copy_rows_cpu(view, column, rest)
            else:
                _copy_rows_cpu(column, view, rest)


class CopyEngine:
    """Block copies for one attached cache and one tier (one thread drives it).

    On CPU a run is a slice copy or a ``memmove`` per row, region by region,
    or one strided copy for a group of equally spaced regions of one buffer.
    On CUDA (``staging.StagedCopier``) the pairs go through two device
    staging buffers in tier-row layout: a gather on the copy stream, which
    first waits for the engine's compute stream, and one contiguous transfer
    per chunk to or from the pinned tier on a transfer stream.

    ``cuda`` forces the CUDA control flow (the recording fakes of the tests
    run it on CPU tensors); by default it follows the cache's device."""

    def __init__(
        self,
        cache: EngineCache,
        tier: CpuTier,
        compute_stream: Any = None,
        staging_bytes: int = STAGING_BYTES,
        cuda: bool | None = None,
    ):
        if not tier.fits(cache.descriptor):
            raise CacheError("bad_layout", "the CPU tier's rows do not match the cache's regions (page shape differs)")
        self.cache = cache
        self.tier = tier
        self.cuda = cache.device.type == "cuda" if cuda is None else cuda
        if self.cuda and cache.device.type == "cuda" and not tier.pinned:
            raise CacheError(
                "bad_layout", "on CUDA the CPU tier must be pinned (asynchronous copies, no driver staging)"
            )
        self.staged = StagedCopier(cache, tier.store, compute_stream, staging_bytes) if self.cuda else None

    def _groups_cpu(self, views: list[torch.Tensor]) -> list[CpuGroup]:
        """(engine ``[count, blocks, page]``, tier ``[rows, count, page]``, its region views, its tier
        columns, and numpy views of the first two) per group; kept by the cache
        (``EngineCache.derived``), so its release drops them, numpy views too."""
        out, i = [], 0
        for g in group_regions(views, 1):
            tier3 = self.tier.store[:, g.column : g.column + g.count * g.page].view(self.tier.rows, g.count, g.page)
            out.append(
                (
                    g.source,
                    tier3,
                    views[i : i + g.count],
                    self.tier.columns[i : i + g.count],
                    g.source.numpy(),
                    tier3.numpy(),
                )
            )
            i += g.count
        return out

    def close(self) -> None:
        """Drop the device staging buffers (call on clear, with ``cache.release()``)."""
        if self.staged is not None:
            self.staged.close()

    def swap_out(self, src_blocks: Sequence[int], dst_rows: Sequence[int], wait_event: Any = None) -> int:
        """Copy engine blocks into tier rows; return bytes moved once the bytes are there."""
        self._check(src_blocks, dst_rows)
        check_ids("src", src_blocks, "gpu", self.cache.num_blocks, False, self.cache.descriptor.reserved_ids)
        check_ids("dst", dst_rows, "cpu", self.tier.rows, unique=True)
        return self.copy_out(src_blocks, dst_rows, wait_event)

    def swap_in(self, src_rows: Sequence[int], dst_blocks: Sequence[int], wait_event: Any = None) -> int:
        """Copy tier rows into engine blocks; return bytes moved once the bytes are there."""
        self._check(src_rows, dst_blocks)
        check_ids("src", src_rows, "cpu", self.tier.rows, unique=False)
        check_ids("dst", dst_blocks, "gpu", self.cache.num_blocks, True, self.cache.descriptor.reserved_ids)
        return self.copy_in(src_rows, dst_blocks, wait_event)

    def copy_out(self, src_blocks: Sequence[int], dst_rows: Sequence[int], wait_event: Any = None) -> int:
        """``swap_out`` for ids a caller has already checked (``BlockStore.validate``)."""
        if self.staged is not None:
            self.staged.swap_out(src_blocks, dst_rows, wait_event)
        else:
            _copy_groups_cpu(
                self.cache.derived("cpu_groups", self._groups_cpu), coalesce(src_blocks, dst_rows), out=True
            )
        return len(src_blocks) * self.cache.descriptor.block_bytes

    def copy_in(self, src_rows: Sequence[int], dst_blocks: Sequence[int], wait_event: Any = None) -> int:
        """``swap_in`` for ids a caller has already checked (``BlockStore.validate``)."""
        if self.staged is not None:
            self.staged.swap_in(src_rows, dst_blocks, wait_event)
        else:
            _copy_groups_cpu(
                self.cache.derived("cpu_groups", self._groups_cpu), coalesce(src_rows, dst_blocks), out=False
            )
        return len(src_rows) * self.cache.descriptor.block_bytes

    def _check(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if self.cache.released:
            raise CacheError("released", "the engine cache was released (cleared); attach a new generation")
        if len(src) != len(dst) or not src:
            raise CacheError(
                "bad_block_id", f"src and dst must be equally long and non-empty ({len(src)} vs {len(dst)})"
            )
        for b in (*src, *dst):
            if type(b) is not int:
                raise CacheError("bad_block_id", f"block id {b!r} is not an integer")
