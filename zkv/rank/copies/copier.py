"""The copy engine between an engine's regions and zkv's CPU tier.

``swap_out(blocks -> rows)`` and ``swap_in(rows -> blocks)`` sort the id
pairs by tier row and move each run of consecutive rows with one call per
group of regions: a slice copy where the blocks are consecutive too, an
indexed copy (a ``memcpy`` per page in C) where they are not; rows scattered
too go through a staging buffer: no Python per page, no ``index_put_``
temporaries (each costs a fresh buffer and its page faults) (``cpu_copy``).
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

from typing import Any, Sequence

import torch

from ...wire.vocab import Tier
from ..errors import CacheError
from ..memory.regions import EngineCache, check_ids
from ..tiers.cpu_tier import CpuTier
from .cpu_copy import CpuCopier, CpuGroup, Span, coalesce, groups_of
from .staging import STAGING_BYTES, StagedCopier

__all__ = ["CopyEngine", "coalesce"]


class CopyEngine:
    """Block copies for one attached cache and one tier (one thread drives it).

    On CPU (``cpu_copy.CpuCopier``) a run of tier rows is one slice or indexed
    copy per group of equally spaced regions of one buffer.
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
        self.cpu = (
            None
            if self.cuda
            else CpuCopier(
                tier,
                lambda: cache.derived("cpu_groups", self._groups_cpu),
                span=lambda: cache.derived("cpu_span", self._span_cpu),
            )
        )

    def _groups_cpu(self, views: list[torch.Tensor]) -> list[CpuGroup]:
        """The CPU path's region groups (``cpu_copy.groups_of``), kept by the cache
        (``EngineCache.derived``), so its release drops them, numpy views too."""
        return groups_of(views, self.tier.store, self.tier.columns)

    def _span_cpu(self, views: list[torch.Tensor]) -> Span | None:
        """The CPU path's byte-addressed view of every region (``cpu_copy.Span``), kept by the cache."""
        return Span.of(views)

    def close(self) -> None:
        """Drop the device staging buffers (call on clear, with ``cache.release()``)."""
        if self.staged is not None:
            self.staged.close()
        if self.cpu is not None:
            self.cpu.close()

    def swap_out(self, src_blocks: Sequence[int], dst_rows: Sequence[int], wait_event: Any = None) -> int:
        """Copy engine blocks into tier rows; return bytes moved once the bytes are there."""
        self._check(src_blocks, dst_rows)
        check_ids("src", src_blocks, Tier.GPU, self.cache.num_blocks, False, self.cache.descriptor.reserved_ids)
        check_ids("dst", dst_rows, Tier.CPU, self.tier.rows, unique=True)
        return self.copy_out(src_blocks, dst_rows, wait_event)

    def swap_in(self, src_rows: Sequence[int], dst_blocks: Sequence[int], wait_event: Any = None) -> int:
        """Copy tier rows into engine blocks; return bytes moved once the bytes are there."""
        self._check(src_rows, dst_blocks)
        check_ids("src", src_rows, Tier.CPU, self.tier.rows, unique=False)
        check_ids("dst", dst_blocks, Tier.GPU, self.cache.num_blocks, True, self.cache.descriptor.reserved_ids)
        return self.copy_in(src_rows, dst_blocks, wait_event)

    def copy_out(self, src_blocks: Sequence[int], dst_rows: Sequence[int], wait_event: Any = None) -> int:
        """``swap_out`` for ids a caller has already checked (``BlockStore.validate``)."""
        if self.staged is not None:
            self.staged.swap_out(src_blocks, dst_rows, wait_event)
        elif self.cpu is not None:
            self.cpu.copy(dst_rows, src_blocks, out=True)
        return len(src_blocks) * self.cache.descriptor.block_bytes

    def copy_in(self, src_rows: Sequence[int], dst_blocks: Sequence[int], wait_event: Any = None) -> int:
        """``swap_in`` for ids a caller has already checked (``BlockStore.validate``)."""
        if self.staged is not None:
            self.staged.swap_in(src_rows, dst_blocks, wait_event)
        elif self.cpu is not None:
            self.cpu.copy(src_rows, dst_blocks, out=False)
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
